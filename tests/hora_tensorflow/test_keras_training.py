"""Training with hora.keras and hora.tensorflow on 2 workers (Keras on TensorFlow) against 1 worker.

One job: the backend-neutral Keras checks of keras_sections.py (model.fit with DistributedOptimizer,
backward_passes_per_step, the callbacks, load_model), then TensorFlow-only ones: custom loops with
DistributedGradientTape (eager and tf.function, groups, fp16, sparse gradients), hora.tensorflow's
DistributedOptimizer on a Keras and on a TensorFlow 1 optimizer, and XLA refused clearly. Each
distributed run takes half of every batch per worker and must end with the weights 1 worker reaches
on the whole batches (computed on rank 0 in the same job from the same initial weights).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import keras_sections as ks
from tf_job import JobResults, shared_job

# The first module to ask for the shared job runs every module's sections.
pytestmark = pytest.mark.timeout(600)


def _tf_sections() -> list:
    import keras
    import tensorflow as tf

    import hora.tensorflow as hvd

    r, n = hvd.rank(), hvd.size()
    x, y = ks.digits(ks.BATCH * ks.STEPS)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def model(seed: int = 1):
        keras.utils.set_random_seed(seed)
        return ks.example().build_model(dropout=False)

    def weights(m) -> list:
        return [np.array(w) for w in m.get_weights()]

    def batches(distributed: bool):
        for s in range(ks.STEPS):
            rows = slice(s * ks.BATCH, (s + 1) * ks.BATCH)
            bx, by = x[rows], y[rows]
            if distributed:
                half = ks.BATCH // n
                bx, by = bx[r * half:(r + 1) * half], by[r * half:(r + 1) * half]
            yield tf.constant(bx), tf.constant(by)

    def tape_train(distributed: bool, function: bool, **options):
        m = model()
        opt = keras.optimizers.SGD(0.1, momentum=0.9)

        def step(bx, by):
            with tf.GradientTape() as tape:
                loss = loss_fn(by, m(bx, training=True))
            if distributed:
                tape = hvd.DistributedGradientTape(tape, **options)
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables))

        step = tf.function(step) if function else step
        for bx, by in batches(distributed):
            step(bx, by)
        return weights(m)

    reference: list = []

    def tape_reference() -> list:
        """1 worker's plain eager loop on the whole batches (rank 0 only): every tape section and
        tf_optimizer.keras start from model() and train the same batches, so it is computed once."""
        if r != 0:
            return []
        if not reference:
            reference.extend(tape_train(False, False))
        return reference

    def tape_section(function: bool, **options):
        def section():
            return {"weights": tape_train(True, function, **options), "reference": tape_reference()}
        return section

    def tape_details():
        v, unused = tf.Variable([1.0, 2.0]), tf.Variable([5.0])
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(v * v) * (r + 1)
        dtape = hvd.DistributedGradientTape(tape)
        nested = dtape.gradient(loss, {"v": v, "unused": unused})
        again = dtape.gradient(loss, [v])  # persistent: a second gradient() works and is averaged too
        twice = hvd.DistributedGradientTape(dtape)
        return {"nested_v": nested["v"].numpy(), "unused_is_none": nested["unused"] is None,
                "again": again[0].numpy(), "class": type(dtape).__name__,
                "is_tape": isinstance(dtape, tf.GradientTape),
                "rewrapped_once": type(twice).__bases__[-1] is tf.GradientTape,  # the plain class, wrapped once
                "twice": twice.gradient(loss, [v])[0].numpy()}

    def tape_local_sources():
        # Gradients of v are r+1 times [2, 4] on rank r: shared ones are averaged, local ones stay
        # this rank's own (divided by size with scale_local_gradients, as in Horovod).
        v, mine = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
        out = {}
        for scale in (True, False):
            with tf.GradientTape() as tape:
                loss = (tf.reduce_sum(v * v) + tf.reduce_sum(mine * mine)) * (r + 1)
            dtape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
            dtape.register_local_source(mine)
            gv, gmine = dtape.gradient(loss, [v, mine])
            out[scale] = {"v": gv.numpy(), "mine": gmine.numpy()}
        return out

    def optimizer_local_vars():
        # As tape.local_sources, through the optimizers' register_local_var, one step at rate 1:
        # v's gradient is averaged ([3, 6]), mine's is this rank's own 6 (r + 1), halved when scaled.
        def loss_of(v, mine):
            return (tf.reduce_sum(v * v) + tf.reduce_sum(mine * mine)) * (r + 1)

        def make_step(v, mine, opt):
            # Built per optimizer, so that the tf.function captures this iteration's variables.
            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    loss = loss_of(v, mine)
                opt.apply_gradients(zip(tape.gradient(loss, [v, mine]), [v, mine]))

            return step

        out = {}
        for scale in (True, False):
            # a Keras optimizer (through hora.tensorflow's DistributedOptimizer), inside tf.function
            v, mine = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), scale_local_gradients=scale)
            opt.register_local_var(mine)
            make_step(v, mine, opt)()
            out[f"keras.{scale}"] = {"v": v.numpy(), "mine": mine.numpy()}
            # a TensorFlow 1 style optimizer, eagerly
            v, mine = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
            v1 = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                          scale_local_gradients=scale)
            v1.register_local_var(mine)
            v1.minimize(lambda v=v, mine=mine: loss_of(v, mine), var_list=[v, mine])
            out[f"v1.{scale}"] = {"v": v.numpy(), "mine": mine.numpy()}
        return out

    def sparse(sparse_as_dense: bool):
        # rank 0 looks up rows 0, 1, 2, 2 and rank 1 rows 2, 3, 4, 9: row 2 is shared
        def section():
            idx = np.array([[0, 1, 2, 2], [2, 3, 4, 9]])
            target = np.random.default_rng(30).normal(size=(n, 4, 3)).astype(np.float32)

            def train(distributed: bool):
                keras.utils.set_random_seed(6)
                emb = keras.layers.Embedding(10, 3)
                emb.build((None,))
                opt = keras.optimizers.SGD(0.5)
                kinds = []

                @tf.function
                def step(ids, tgt):
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_mean((emb(ids) - tgt) ** 2)
                    if distributed:
                        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
                    grads = tape.gradient(loss, emb.trainable_variables)
                    kinds.append(type(grads[0]).__name__)
                    opt.apply_gradients(zip(grads, emb.trainable_variables))

                for _ in range(3):
                    if distributed:
                        step(tf.constant(idx[r]), tf.constant(target[r]))
                    else:
                        step(tf.constant(idx.reshape(-1)), tf.constant(target.reshape(-1, 3)))
                return weights(emb), kinds

            got, kinds = train(True)
            return {"weights": got, "kinds": kinds, "reference": train(False)[0] if r == 0 else []}
        return section

    def tf_optimizer_keras():
        m = model()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=1)

        @tf.function
        def step(bx, by):
            with tf.GradientTape() as tape:
                loss = loss_fn(by, m(bx, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))

        for bx, by in batches(True):
            step(bx, by)
        return {"weights": weights(m), "reference": tape_reference(),
                "is_sgd": isinstance(opt, keras.optimizers.SGD)}

    def tf_optimizer_v1():
        data = np.random.default_rng(7).normal(size=(8, 3)).astype(np.float32)
        target = data @ np.array([[1.0], [-2.0], [0.5]], np.float32)

        def train(distributed: bool):
            w = tf.Variable(tf.zeros([3, 1]))
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            if distributed:
                opt = hvd.DistributedOptimizer(opt)
            rows = slice(r * 4, (r + 1) * 4) if distributed else slice(None)
            for _ in range(5):
                opt.minimize(lambda: tf.reduce_mean((data[rows] @ w - target[rows]) ** 2), var_list=[w])
            return [w.numpy()], isinstance(opt, tf.compat.v1.train.GradientDescentOptimizer)

        got, is_instance = train(True)
        return {"weights": got, "reference": train(False)[0] if r == 0 else [], "is_instance": is_instance}

    def xla_fit_refused():
        m = model()
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss_fn, jit_compile=True)
        try:
            m.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
            return None
        except Exception as exc:
            return (type(exc).__name__, str(exc))

    return [
        ("tape.eager", tape_section(False)),
        ("tape.function", tape_section(True)),
        ("tape.groups", tape_section(True, num_groups=2)),
        ("tape.predivide", tape_section(True, gradient_predivide_factor=2.0)),
        ("tape.fp16", tape_section(True, compression=hvd.Compression.fp16)),
        ("tape.details", tape_details),
        ("tape.local_sources", tape_local_sources),
        ("optimizer.local_vars", optimizer_local_vars),
        ("tape.sparse", sparse(False)),
        ("tape.sparse_as_dense", sparse(True)),
        ("tf_optimizer.keras", tf_optimizer_keras),
        ("tf_optimizer.v1", tf_optimizer_v1),
        ("xla_fit_refused", xla_fit_refused),
    ]


def _job() -> list:
    return ks.keras_sections() + _tf_sections()


RANKS2 = shared_job(_job, np=2)


@pytest.fixture(scope="module")
def ranks2(request) -> JobResults:
    return RANKS2.results(request)


# ---- model.fit with hora.keras.DistributedOptimizer ------------------------------------------------


@pytest.mark.parametrize("section", ["keras.sgd", "keras.adam", "keras.groups", "keras.groups_lists",
                                     "keras.num_groups", "keras.predivide"])
def test_fit_two_workers_match_one_worker_2ranks(ranks2, section):
    got = ks.check_equivalence(ranks2, section)
    assert got["iterations"] == ks.STEPS
    assert got["is_instance"] and got["class"] in ("SGD", "Adam")


def test_fit_fp16_compression_stays_close_2ranks(ranks2):
    ks.check_equivalence(ranks2, "keras.fp16", **ks.FP16_TOL)


@pytest.mark.parametrize("section,k", [("keras.passes2.average", 2), ("keras.passes2.sum", 2),
                                       ("keras.passes4.average", 4)])
def test_backward_passes_per_step_equals_k_times_larger_batches_2ranks(ranks2, section, k):
    got = ks.check_equivalence(ranks2, section)
    assert got["iterations"] == ks.STEPS * k  # every call counts, as in Horovod


# ---- callbacks ----------------------------------------------------------------------------------------


def test_broadcast_callback_makes_every_rank_start_from_the_root_2ranks(ranks2):
    ks.check_broadcast_callback(ranks2)


def test_metric_average_callback_logs_the_mean_over_ranks_2ranks(ranks2):
    ks.check_metric_average(ranks2)


def test_learning_rate_warmup_and_schedule_values_2ranks(ranks2):
    ks.check_learning_rate_callbacks(ranks2)


def test_momentum_correction_scales_momentum_buffers_2ranks(ranks2):
    ks.check_momentum_correction(ranks2)


def test_load_model_rewraps_the_saved_optimizer_2ranks(ranks2):
    ks.check_load_model(ranks2)


def test_mixed_precision_ranks_skip_overflowing_steps_together_2ranks(ranks2):
    ks.check_mixed_precision(ranks2)


# ---- custom loops with DistributedGradientTape ---------------------------------------------------------


@pytest.mark.parametrize("section", ["tape.eager", "tape.function", "tape.groups", "tape.predivide"])
def test_gradient_tape_two_workers_match_one_worker_2ranks(ranks2, section):
    ks.check_equivalence(ranks2, section)


def test_gradient_tape_fp16_2ranks(ranks2):
    ks.check_equivalence(ranks2, "tape.fp16", **ks.FP16_TOL)


def test_gradient_tape_details_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("tape.details", r)
        np.testing.assert_allclose(got["nested_v"], [3.0, 6.0])  # 2 v (r + 1), averaged over ranks
        np.testing.assert_allclose(got["again"], [3.0, 6.0])
        np.testing.assert_allclose(got["twice"], [3.0, 6.0])  # wrapping twice does not average twice
        assert got["unused_is_none"] and got["is_tape"] and got["rewrapped_once"]
        assert got["class"] == "GradientTape"


def test_gradient_tape_local_sources_keep_their_own_gradient_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("tape.local_sources", r)
        for scale in (True, False):
            np.testing.assert_allclose(got[scale]["v"], [3.0, 6.0])  # mean of [2, 4] and [4, 8]
            own = 6.0 * (r + 1)
            np.testing.assert_allclose(got[scale]["mine"], [own / 2 if scale else own])


def test_optimizer_local_vars_keep_their_own_gradient_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("optimizer.local_vars", r)
        for kind in ("keras", "v1"):
            for scale in (True, False):
                step = got[f"{kind}.{scale}"]
                np.testing.assert_allclose(step["v"], [1.0 - 3.0, 2.0 - 6.0])  # the same on both ranks
                own = 6.0 * (r + 1)
                np.testing.assert_allclose(step["mine"], [3.0 - (own / 2 if scale else own)])


@pytest.mark.parametrize("section,kind", [("tape.sparse", "IndexedSlices"),
                                          ("tape.sparse_as_dense", "EagerTensor")])
def test_sparse_gradients_2ranks(ranks2, section, kind):
    ks.check_equivalence(ranks2, section)
    kinds = ranks2.get(section, 0)["kinds"]
    assert kinds and kinds[0] in ("IndexedSlices", "Tensor", "SymbolicTensor", "EagerTensor")
    assert (kinds[0] == "IndexedSlices") == (kind == "IndexedSlices")


def test_tensorflow_distributed_optimizer_keras_and_v1_2ranks(ranks2):
    assert ks.check_equivalence(ranks2, "tf_optimizer.keras")["is_sgd"]
    assert ks.check_equivalence(ranks2, "tf_optimizer.v1", rtol=1e-5, atol=1e-6)["is_instance"]


def test_fit_with_jit_compile_is_refused_clearly_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("xla_fit_refused", r)
        assert got is not None and "jit_compile=False" in got[1], got
