"""Horovod's Keras 2 gradient hooks and local gradient aggregation, on tf_keras' current optimizers
(``tf_keras.optimizers.SGD`` & co., what ``tf.keras.optimizers`` is under TF_USE_LEGACY_KERAS=1) and,
for comparison, on the legacy ones, in one job of 2 ranks and one of 3.

Horovod's own Keras 2 tests drive the wrapper through ``_compute_gradients`` (the hook Keras 2's
``minimize`` calls), then ``apply_gradients``; these checks do the same, and ``minimize``, and
``model.fit``. Gradients are built so that each rank's is known (a multiple of rank + 1, and of the
pass number, so sums over passes show up), and SGD with learning rate 1 turns the applied gradient
into the change of the variable: values are compared exactly, or (where a model's floating-point
gradients are averaged) to float32 rounding. ``hvd`` is hora.keras, ``tfk`` Horovod's spelling
hora.tensorflow.keras; both are used.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tf_keras")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hora_tensorflow"))  # the TensorFlow job helpers
from tf_job import JobResults, shared_job

# The first module to ask for the shared job runs every module's sections.
pytestmark = pytest.mark.timeout(600)

SIZES = (2, 3)
PASSES = 4  # backward_passes_per_step of the aggregation sections
TOTAL_PASSES = 10
FAMILIES = ["new", "legacy"]
FLOAT32 = {"rtol": 1e-6, "atol": 1e-7}


def _job() -> list:
    import tensorflow as tf
    import tf_keras as K

    import hora.keras as hvd
    import hora.tensorflow.keras as tfk

    r = hvd.rank()
    scale = float(r + 1)

    def sgd(family: str, lr: float = 1.0):
        return K.optimizers.SGD(learning_rate=lr) if family == "new" else K.optimizers.legacy.SGD(learning_rate=lr)

    def counter(opt) -> int:
        return int(opt._agg_helper.counter.numpy())

    def hooks(family: str):
        def one_spelling(module) -> dict:
            v = tf.Variable([1.0, 1.0, 1.0])
            w = tf.constant([1.0, 2.0, 3.0])
            opt = module.DistributedOptimizer(sgd(family))
            pairs = opt._compute_gradients(lambda: tf.reduce_sum(v * w * scale), [v])
            with tf.GradientTape() as tape:
                value = tf.reduce_sum(v * w * scale)
            doubled = opt._compute_gradients(value, [v], grad_loss=tf.constant(2.0), tape=tape)
            try:
                opt._compute_gradients(value, [v])
                no_tape = None
            except ValueError as exc:
                no_tape = str(exc)
            opt.apply_gradients(pairs)
            applied = v.numpy()
            opt.minimize(lambda: tf.reduce_sum(v * w * scale), [v])
            return {"grad": pairs[0][0].numpy(), "doubled": doubled[0][0].numpy(), "no_tape": no_tape,
                    "applied": applied, "minimized": v.numpy(), "iterations": int(opt.iterations.numpy()),
                    "same_var": pairs[0][1] is v, "cls": type(opt).__name__}

        def section():
            out = {"hvd": one_spelling(hvd), "tfk": one_spelling(tfk)}
            # the call Horovod's tests make: tf.keras (tf_keras here), k=2, sparse_as_dense, default SGD;
            # the first pass returns this rank's own gradient, not reduced
            x = tf.Variable(0.0)
            family_module = tf.keras.optimizers if family == "new" else tf.keras.optimizers.legacy
            opt = tfk.DistributedOptimizer(family_module.SGD(), backward_passes_per_step=2, sparse_as_dense=True)
            first = opt._compute_gradients(lambda: x * scale, [x])
            out["issue"] = (float(first[0][0].numpy()), tf.keras.optimizers.SGD is K.optimizers.SGD)
            return out
        return section

    def aggregation(family: str, average: bool):
        def section():
            opt = hvd.DistributedOptimizer(sgd(family), backward_passes_per_step=PASSES,
                                           average_aggregated_gradients=average, sparse_as_dense=True)
            x = tf.Variable([0.0, 0.0])
            y = tf.Variable([1.0, 2.0, 3.0])
            p = tf.Variable(0.0, trainable=False)  # the pass number, 1-based inside the loss

            def loss():
                # dloss/dx = p (r+1) [1, 2]; dloss/dy = -p (r+1) [1, 0, 0], an IndexedSlices (tf.gather)
                return p * scale * (tf.reduce_sum(x * [1.0, 2.0]) - tf.reduce_sum(tf.gather(y, [0])))

            @tf.function
            def step():
                p.assign_add(1.0)
                pairs = opt._compute_gradients(loss, var_list=[x, y])
                opt.apply_gradients(pairs, experimental_aggregate_gradients=False)
                return [g for g, _ in pairs]

            rows = []
            for _ in range(TOTAL_PASSES):
                grads = step()
                rows.append({"gx": grads[0].numpy(), "gy": np.asarray(tf.convert_to_tensor(grads[1])),
                             "x": x.numpy(), "y": y.numpy(), "iterations": int(opt.iterations.numpy()),
                             "counter": counter(opt)})
            return rows
        return section

    def inf_first_pass(family: str):
        def section():
            step_count = tf.Variable(0, trainable=False)
            opt = tfk.DistributedOptimizer(sgd(family), backward_passes_per_step=2, sparse_as_dense=True)
            a, b = tf.Variable(0.0), tf.Variable(10.0)

            def loss():
                step_count.assign_add(1)
                first = a * float("inf")  # d/da is infinite on the first pass only
                return tf.cond(step_count > 1, lambda: a * scale, lambda: first) + b * scale

            rows = []
            for _ in range(4):
                pairs = opt._compute_gradients(loss=loss, var_list=[a, b])
                opt.apply_gradients(pairs)
                sums = [float(s.numpy()) for s in opt._agg_helper.locally_aggregated_grads.values()]
                rows.append({"ga": float(pairs[0][0].numpy()), "gb": float(pairs[1][0].numpy()),
                             "a": float(a.numpy()), "b": float(b.numpy()), "counter": counter(opt), "sums": sums})
            return rows
        return section

    def local_vars(family: str):
        def run(passes: int) -> list:
            opt = hvd.DistributedOptimizer(sgd(family), backward_passes_per_step=passes, sparse_as_dense=True)
            xs = [tf.Variable([0.0]) for _ in range(4)]
            ys = [tf.Variable([1.0, 2.0]) for _ in range(4)]
            for i in range(2):  # the first two of each kind stay on their rank
                opt.register_local_var(xs[i])
                opt.register_local_var(ys[i])
            p = tf.Variable(0.0, trainable=False)

            def loss():
                # dloss/dx_i = p (r+1); dloss/dy_i = -p (r+1) [1, 0], gathered (IndexedSlices)
                gathered = tf.stack([tf.gather(y, [0]) for y in ys])
                return p * scale * (tf.reduce_sum(tf.stack(xs)) - tf.reduce_sum(gathered))

            @tf.function
            def step():
                p.assign_add(1.0)
                pairs = opt._compute_gradients(loss, var_list=[xs, ys])  # nested, as Horovod's test passes it
                opt.apply_gradients(pairs)

            seen = []
            for _ in range(2 * passes):
                step()
                seen.append(([float(x.numpy()[0]) for x in xs], [y.numpy().tolist() for y in ys],
                             int(opt.iterations.numpy())))
            return seen

        return lambda: {passes: run(passes) for passes in (1, 2)}

    def partial(family: str):
        def section():
            def make_model():
                init = K.initializers.Constant(float(r))
                m = K.Sequential([
                    K.layers.Dense(2, input_shape=(3,), kernel_initializer=init, bias_initializer=init),
                    K.layers.RepeatVector(3),
                    K.layers.TimeDistributed(K.layers.Dense(3, kernel_initializer=init, bias_initializer=init)),
                ])
                m.compile(loss=K.losses.MeanSquaredError())
                return m

            rng = np.random.default_rng(40 + r)
            features = rng.random((1, 3)).astype(np.float32)
            targets = rng.random((1, 3, 3)).astype(np.float32)
            out = []
            for local_count, module, passes in ((0, hvd, 1), (1, tfk, 1), (3, hvd, 1), (1, tfk, 2)):
                m = make_model()
                with tf.GradientTape(persistent=True) as tape:
                    value = m.loss(targets, m(features, training=True))
                own = [g.numpy() for g in tape.gradient(value, m.trainable_weights)]
                local_layers = m.layers[:local_count]
                opt = module.PartialDistributedOptimizer(
                    K.optimizers.Adam() if family == "new" else K.optimizers.legacy.Adam(),
                    sparse_as_dense=True, local_layers=local_layers, backward_passes_per_step=passes)
                for _ in range(passes):
                    pairs = opt._compute_gradients(value, m.trainable_weights, tape=tape)
                local_refs = {v.ref() for layer in local_layers for v in layer.trainable_weights}
                got = [g.numpy() for g, _ in pairs]
                is_local = [v.ref() in local_refs for v in m.trainable_weights]
                out.append((local_count, passes, own, got, is_local, hvd.allgather_object(own)))
            return out
        return section

    def sparse_fit(family: str):
        def section():
            vocab, width, batch = 12, 3, 4
            rng = np.random.default_rng(7 + r)
            ids = rng.integers(0, vocab, size=(3 * batch, 5))
            targets = rng.random((3 * batch, 5, width)).astype(np.float32)
            loss_fn = K.losses.MeanSquaredError()

            def make_model():
                K.utils.set_random_seed(5)
                m = K.Sequential([K.layers.Embedding(vocab, width, input_length=5)])
                m.build((None, 5))
                return m

            m = make_model()
            start = m.get_weights()[0]
            own, kinds = [], []
            for s in range(2):  # passes 1 and 2 both see the starting table: nothing is applied in between
                with tf.GradientTape() as tape:
                    value = loss_fn(targets[s * batch:(s + 1) * batch], m(ids[s * batch:(s + 1) * batch]))
                grad = tape.gradient(value, m.trainable_weights)[0]
                kinds.append(type(grad).__name__)
                own.append(np.asarray(tf.convert_to_tensor(grad)))
            opt = hvd.DistributedOptimizer(sgd(family), sparse_as_dense=True, backward_passes_per_step=2)
            m.compile(optimizer=opt, loss=loss_fn)
            after = []

            class Record(K.callbacks.Callback):
                def on_train_batch_end(self, batch_index, logs=None):
                    after.append((m.get_weights()[0], counter(opt), int(opt.iterations.numpy())))

            m.fit(ids, targets, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Record()])
            # Horovod's own check: train_on_batch 3 times leaves the counter at 3 % 2
            m2 = make_model()
            opt2 = tfk.DistributedOptimizer(sgd(family, 0.01), sparse_as_dense=True, backward_passes_per_step=2)
            m2.compile(optimizer=opt2, loss=loss_fn)
            for _ in range(3):
                m2.train_on_batch(ids[:batch], targets[:batch])
            return {"start": start, "own": own, "everyone": hvd.allgather_object(own), "kinds": kinds,
                    "after": after, "train_on_batch_counter": counter(opt2)}
        return section

    def sparse_needs_dense(family: str):
        def section():
            y = tf.Variable([1.0, 2.0, 3.0])
            opt = hvd.DistributedOptimizer(sgd(family), backward_passes_per_step=2)
            try:
                opt._compute_gradients(lambda: tf.reduce_sum(tf.gather(y, [0])), [y])
            except ValueError as exc:
                return str(exc)
            return None
        return section

    def minimize_apply(family: str):
        def section():
            opt = hvd.DistributedOptimizer(sgd(family), backward_passes_per_step=2)
            v = tf.Variable([0.0, 0.0])
            w = tf.constant([1.0, 2.0])
            seen = []
            for _ in range(2):
                opt.minimize(lambda: tf.reduce_sum(v * w) * scale, [v])
                seen.append(v.numpy())
            for _ in range(2):  # a custom loop's own tape gradients: reduced and aggregated by apply_gradients
                with tf.GradientTape() as tape:
                    value = tf.reduce_sum(v * w) * scale * 2.0
                opt.apply_gradients(zip(tape.gradient(value, [v]), [v]))
                seen.append(v.numpy())
            return seen, int(opt.iterations.numpy())
        return section

    def spellings():
        return [getattr(hvd, name) is getattr(tfk, name)
                for name in ("DistributedOptimizer", "PartialDistributedOptimizer", "load_model")]

    sections = [("spellings", spellings)]
    for family in FAMILIES:
        sections += [
            (f"hooks_{family}", hooks(family)),
            (f"aggregation_{family}_sum", aggregation(family, False)),
            (f"aggregation_{family}_average", aggregation(family, True)),
            (f"inf_first_pass_{family}", inf_first_pass(family)),
            (f"local_vars_{family}", local_vars(family)),
            (f"partial_{family}", partial(family)),
            (f"sparse_fit_{family}", sparse_fit(family)),
            (f"sparse_needs_dense_{family}", sparse_needs_dense(family)),
            (f"minimize_apply_{family}", minimize_apply(family)),
        ]
    return sections


JOBS = {n: shared_job(_job, n, {"TF_USE_LEGACY_KERAS": "1"}) for n in SIZES}


@pytest.fixture(scope="module", params=SIZES, ids=[f"{n}ranks" for n in SIZES])
def job(request) -> JobResults:
    return JOBS[request.param].results(request)


def mean_factor(job: JobResults) -> float:
    """The mean over the ranks of (rank + 1): what averaging makes of gradients proportional to it."""
    return (job.size + 1) / 2


def test_both_spellings_are_the_same_objects(job):
    for rank in range(job.size):
        assert all(job.get("spellings", rank))


@pytest.mark.parametrize("family", FAMILIES)
def test_compute_gradients_hook_returns_averaged_gradients(job, family):
    w = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    for rank in range(job.size):
        out = job.get(f"hooks_{family}", rank)
        for spelling in ("hvd", "tfk"):
            got = out[spelling]
            np.testing.assert_array_equal(got["grad"], mean_factor(job) * w)
            np.testing.assert_array_equal(got["doubled"], 2 * mean_factor(job) * w)  # grad_loss scales the gradient
            assert got["no_tape"] is not None and "tape" in got["no_tape"]
            np.testing.assert_array_equal(got["applied"], 1 - mean_factor(job) * w)  # SGD, learning rate 1
            np.testing.assert_array_equal(got["minimized"], 1 - 2 * mean_factor(job) * w)
            assert got["iterations"] == 2 and got["same_var"] and got["cls"] == "SGD"
        assert out["issue"] == (rank + 1, True)  # the first of 2 passes: this rank's own gradient


def _expected_aggregation(job: JobResults, rank: int, average: bool) -> list[dict]:
    """Per pass: the gradient the hook returns, the variables after apply_gradients, the counter."""
    wx, wy = np.array([1.0, 2.0]), np.array([-1.0, 0.0, 0.0])
    x, y = np.zeros(2), np.array([1.0, 2.0, 3.0])
    rows, running = [], 0.0
    for p in range(1, TOTAL_PASSES + 1):
        running += p
        if p % PASSES == 0:  # reduced: the mean over ranks of the sums, divided by k with averaging
            factor = mean_factor(job) * running / (PASSES if average else 1)
            x, y = x - factor * wx, y - factor * wy
            rows.append({"gx": factor * wx, "gy": factor * wy, "x": x, "y": y, "counter": 0})
            running = 0.0
        else:  # not reduced: this rank's running sum, as Horovod's eager helper returns it
            factor = (rank + 1) * running
            rows.append({"gx": factor * wx, "gy": factor * wy, "x": x, "y": y, "counter": p % PASSES})
    return rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("average", [False, True], ids=["sum", "average"])
def test_gradient_aggregation_in_tf_function(job, family, average):
    for rank in range(job.size):
        got = job.get(f"aggregation_{family}_{'average' if average else 'sum'}", rank)
        want = _expected_aggregation(job, rank, average)
        for p, (g, w) in enumerate(zip(got, want), start=1):
            for key in ("gx", "gy", "x", "y"):
                np.testing.assert_array_equal(g[key], w[key].astype(np.float32), err_msg=f"{key} after pass {p}")
            assert g["counter"] == w["counter"], p
            assert g["iterations"] == p  # the passes in between count iterations too (Horovod)


@pytest.mark.parametrize("family", FAMILIES)
def test_infinite_first_pass_is_cleared_and_the_next_cycle_is_unaffected(job, family):
    for rank in range(job.size):
        rows = job.get(f"inf_first_pass_{family}", rank)
        assert rows[0]["ga"] == np.inf and rows[0]["a"] == 0.0  # pass 1: summed locally, not applied
        assert rows[1]["ga"] == np.inf and rows[1]["a"] == -np.inf  # pass 2: reduced and applied
        assert rows[1]["sums"] == [0.0, 0.0] and rows[1]["counter"] == 0  # cleared once reduced
        assert rows[2]["ga"] == rank + 1  # pass 3 starts from a clean sum: no inf left over
        assert rows[3]["ga"] == 2 * mean_factor(job)  # cycle 2's reduced sum is finite
        assert [row["gb"] for row in rows] == [rank + 1, mean_factor(job) * 2, rank + 1, mean_factor(job) * 2]
        assert [row["b"] for row in rows] == [10.0, 10.0 - 2 * mean_factor(job), 10.0 - 2 * mean_factor(job),
                                              10.0 - 4 * mean_factor(job)]


@pytest.mark.parametrize("family", FAMILIES)
def test_register_local_var_keeps_local_gradients_with_and_without_aggregation(job, family):
    for rank in range(job.size):
        out = job.get(f"local_vars_{family}", rank)
        for passes in (1, 2):
            seen = out[passes]
            for p, (xs, ys, iterations) in enumerate(seen, start=1):
                assert iterations == p
                applied = sum(range(1, p + 1)) if p % passes == 0 else sum(range(1, p - p % passes + 1))
                local = (rank + 1) * applied / job.size  # this rank's own sum, divided by the size (Horovod)
                shared = mean_factor(job) * applied
                # exact at 2 ranks; at 3, local is a third, rounded to float32 as the variables hold it
                np.testing.assert_allclose(xs, [-local, -local, -shared, -shared], err_msg=f"{passes} {p}", **FLOAT32)
                np.testing.assert_allclose(ys, [[1.0 + local, 2.0]] * 2 + [[1.0 + shared, 2.0]] * 2,
                                           err_msg=f"{passes} {p}", **FLOAT32)


@pytest.mark.parametrize("family", FAMILIES)
def test_partial_distributed_optimizer_compute_gradients(job, family):
    for rank in range(job.size):
        for local_count, passes, own, got, is_local, everyone in job.get(f"partial_{family}", rank):
            assert sum(is_local) == {0: 0, 1: 2, 3: 4}[local_count]  # the middle layer has no weights
            for i, (g, local) in enumerate(zip(got, is_local)):
                if local:  # this rank's own gradient (summed over the passes), divided by the size
                    np.testing.assert_allclose(g, passes * own[i] / job.size, **FLOAT32)
                else:  # the mean over ranks
                    mean = np.mean([passes * e[i] for e in everyone], axis=0)
                    np.testing.assert_allclose(g, mean, **FLOAT32)
            assert any(not np.allclose(e[-1], everyone[0][-1]) for e in everyone)  # the ranks' gradients differ


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_as_dense_with_aggregation_in_model_fit(job, family):
    results = [job.get(f"sparse_fit_{family}", rank) for rank in range(job.size)]
    for out in results:
        assert out["kinds"] == ["IndexedSlices", "IndexedSlices"]
        start, everyone = out["start"], out["everyone"]
        reduced = np.mean([e[0] + e[1] for e in everyone], axis=0)
        (w1, c1, i1), (w2, c2, i2), (w3, c3, i3) = out["after"]
        np.testing.assert_array_equal(w1, start)  # pass 1: nothing applied
        np.testing.assert_allclose(w2, start - reduced, **FLOAT32)  # pass 2: the mean of the summed gradients
        np.testing.assert_array_equal(w3, w2)
        assert (c1, c2, c3) == (1, 0, 1) and (i1, i2, i3) == (1, 2, 3)
        assert out["train_on_batch_counter"] == 3 % 2
    np.testing.assert_array_equal(results[0]["after"][-1][0], results[1]["after"][-1][0])


@pytest.mark.parametrize("family", FAMILIES)
def test_aggregating_indexed_slices_needs_sparse_as_dense(job, family):
    for rank in range(job.size):
        message = job.get(f"sparse_needs_dense_{family}", rank)
        assert message is not None and "sparse_as_dense" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_minimize_and_apply_gradients_aggregate(job, family):
    for rank in range(job.size):
        seen, iterations = job.get(f"minimize_apply_{family}", rank)
        w = np.array([1.0, 2.0], dtype=np.float32)
        first = -2 * mean_factor(job) * w  # two passes of gradient (r+1) w, averaged over ranks
        np.testing.assert_array_equal(seen[0], [0.0, 0.0])
        np.testing.assert_array_equal(seen[1], first)
        np.testing.assert_array_equal(seen[2], first)
        np.testing.assert_array_equal(seen[3], first - 4 * mean_factor(job) * w)
        assert iterations == 4
