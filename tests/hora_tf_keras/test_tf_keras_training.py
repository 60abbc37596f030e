"""hora.keras and hora.tensorflow.keras on Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1) on 2 workers.

The Keras choice is fixed per process, so the workers get TF_USE_LEGACY_KERAS=1 in their
environment and this pytest process never imports tf_keras' models. One 2-rank job runs every
check as a section (see tests/sections.py): each distributed run takes half of every batch per
worker and must end with the weights 1 worker reaches on the whole batches (computed on rank 0
in the same job, from the same initial weights), for tf_keras' optimizers and its legacy ones.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tf_keras")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hora_tensorflow"))  # the TensorFlow job helpers
from tf_job import JobResults, shared_job

# The first module to ask for the shared job runs every module's sections.
pytestmark = pytest.mark.timeout(600)

BATCH, STEPS = 16, 20
TOL = dict(rtol=2e-4, atol=2e-5)
OPTIMIZERS = ["sgd", "adam", "legacy_sgd", "legacy_adam"]
SCORES = [3.0, 2.0, 2.5, 1.0, 1.5]  # a monitored metric that improves at epochs 0, 1 and 3


def _job() -> list:
    import tensorflow as tf
    import tf_keras as K
    from sklearn.datasets import load_digits

    import hora.keras as hvd
    import hora.tensorflow.keras as tfk

    r, n = hvd.rank(), hvd.size()
    digits = load_digits()
    x = (digits.data[:BATCH * STEPS * 2] / 16.0).astype(np.float32)
    y = digits.target[:BATCH * STEPS * 2].astype(np.int64)
    # Each rank writes its own files (named by rank); the last section removes the directory.
    out_dir = tempfile.mkdtemp(prefix=f"hora-tf-keras-{r}-")

    def make(kind: str):
        return {"sgd": lambda: K.optimizers.SGD(0.1, momentum=0.9),
                "adam": lambda: K.optimizers.Adam(0.01),
                "legacy_sgd": lambda: K.optimizers.legacy.SGD(lr=0.1, momentum=0.9),  # Keras 2's `lr`
                "legacy_adam": lambda: K.optimizers.legacy.Adam(lr=0.01)}[kind]()

    def model(seed: int = 1):
        K.utils.set_random_seed(seed)
        return K.Sequential([K.layers.Dense(16, activation="tanh", input_shape=(64,)), K.layers.Dense(10)])

    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)

    def weights(m) -> list:
        return [np.array(w) for w in m.get_weights()]

    def fit(m, opt, batch: int, steps: int, distributed: bool) -> list:
        m.compile(opt, loss)
        bx, by = x[:batch * steps], y[:batch * steps]
        if distributed:  # rank r takes its half of every global batch
            rows = np.concatenate([np.arange(s * batch + r * batch // n, s * batch + (r + 1) * batch // n)
                                   for s in range(steps)])
            bx, by, batch = bx[rows], by[rows], batch // n
        m.fit(bx, by, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        return weights(m)

    references: dict[tuple[str, int], list] = {}

    def reference(kind: str, k: int) -> list:
        """1 worker from model()'s (seeded) start on global batches of k * BATCH rows (rank 0 only). It
        depends only on the optimizer and k, so sections that share them (equivalence_legacy_sgd and
        tensorflow_wrapper) share one fit instead of each compiling its own."""
        if (kind, k) not in references:
            references[kind, k] = fit(model(), make(kind), BATCH * k, STEPS // k, False)
        return references[kind, k]

    def equivalence(kind: str, wrapper=None, **options):
        def section():
            wrap = wrapper or hvd.DistributedOptimizer
            got = fit(model(), wrap(make(kind), **options), BATCH, STEPS, True)
            k = options.get("backward_passes_per_step", 1)
            # k passes averaged locally == one step of 1 worker on k global batches at once
            want = reference(kind, k) if r == 0 else None
            return got, want, weights(model())
        return section

    def custom_loop():
        # apply_gradients on a plain tape's gradients (a custom loop): hora reduces them there
        m, opt = model(), hvd.DistributedOptimizer(make("adam"))
        ref, ref_opt = model(), make("adam")

        @tf.function
        def step(mm, o, bx, by):
            with tf.GradientTape() as tape:
                value = loss(by, mm(bx, training=True))
            o.apply_gradients(zip(tape.gradient(value, mm.trainable_variables), mm.trainable_variables))

        half = BATCH // n
        for s in range(STEPS):
            rows = slice(s * BATCH + r * half, s * BATCH + (r + 1) * half)
            step(m, opt, x[rows], y[rows])
            if r == 0:
                whole = slice(s * BATCH, (s + 1) * BATCH)
                step.python_function(ref, ref_opt, x[whole], y[whole])
        return weights(m), weights(ref) if r == 0 else None

    def horovod_hooks():
        # Horovod's Keras 2 entry points return reduced gradients; sparse_as_dense densifies
        v = tf.Variable(tf.ones([3]))
        legacy = hvd.DistributedOptimizer(make("legacy_sgd"))
        grads = legacy._compute_gradients(lambda: tf.reduce_sum(v * float(r + 1)), [v])
        emb = K.layers.Embedding(6, 2)
        emb.build((None,))
        dense = hvd.DistributedOptimizer(make("sgd"), sparse_as_dense=True)
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(emb(tf.constant([r, 4])))
        pairs = dense.compute_gradients(value, emb.trainable_variables, tape=tape)
        return (np.array(grads[0][0]), type(pairs[0][0]).__name__, np.array(tf.convert_to_tensor(pairs[0][0])),
                type(legacy).__name__, isinstance(legacy, K.optimizers.legacy.SGD))

    def callbacks():
        m = model(seed=10 + r)  # different on purpose: the broadcast aligns them
        opt = hvd.DistributedOptimizer(make("legacy_sgd"))

        class Record(K.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.lrs, self.logged = [], []

            def on_train_batch_begin(self, batch, logs=None):
                self.lrs.append(float(K.backend.get_value(self.model.optimizer.lr)))

            def on_epoch_end(self, epoch, logs=None):
                self.logged.append(dict(logs))

        class RankMetric(K.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                logs["rank_metric"] = float(r)

        record = Record()
        m.compile(opt, loss)
        m.fit(x[:64], y[:64], batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
            tfk.callbacks.BroadcastGlobalVariablesCallback(0), RankMetric(), tfk.callbacks.MetricAverageCallback(),
            tfk.callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=2, steps_per_epoch=8), record])
        return weights(m), record.lrs, [(d["rank_metric"], d["lr"]) for d in record.logged]

    def load_model_round_trip():
        m = model()
        m.compile(hvd.DistributedOptimizer(make("legacy_sgd")), loss)
        m.fit(x[:32], y[:32], batch_size=8, epochs=1, shuffle=False, verbose=0)
        path = os.path.join(out_dir, f"model{r}.h5")
        m.save(path)
        loaded = tfk.load_model(path, legacy_opts=True)
        opt = loaded.optimizer
        saved_state = [np.array(w) for w in opt.variables()]
        loaded.fit(x[32:64], y[32:64], batch_size=8, epochs=1, shuffle=False, verbose=0)
        new = hvd.load_model(path)  # without legacy_opts: tf_keras' own class choice, wrapped too
        return (isinstance(opt, K.optimizers.legacy.SGD), type(opt).__mro__[1].__name__, int(opt.iterations.numpy()),
                len(saved_state), weights(loaded), type(new.optimizer).__mro__[1].__name__)

    def best_checkpoint():
        m = model()
        m.compile(hvd.DistributedOptimizer(make("sgd")), loss)
        path = os.path.join(out_dir, f"best{r}.h5")
        seen = []

        class Score(K.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                logs["score"] = SCORES[epoch]

        class Watch(K.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                seen.append(os.stat(path).st_mtime_ns if os.path.exists(path) else None)

        checkpoint = tfk.callbacks.BestModelCheckpoint(monitor="score", mode="min")
        checkpoint.filepath = path  # as Horovod's estimators set it
        saves = []
        original = m.save
        m.save = lambda *a, **k: (saves.append(a[0] if a else k.get("filepath")), original(*a, **k))[1]
        m.fit(x[:16], y[:16], batch_size=8, epochs=len(SCORES), verbose=0, callbacks=[Score(), checkpoint, Watch()])
        unset = None
        try:
            m.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0, callbacks=[hvd.callbacks.BestModelCheckpoint()])
        except ValueError as exc:
            unset = str(exc)
        return len(saves), [s is not None for s in seen], len(set(s for s in seen if s)), unset

    def partial():
        K.utils.set_random_seed(3)
        shared, head = K.layers.Dense(4, input_shape=(64,)), K.layers.Dense(10)
        m = K.Sequential([shared, head])
        m.build((None, 64))
        start = weights(m)
        opt = tfk.PartialDistributedOptimizer(K.optimizers.SGD(0.5), local_layers=head)
        rows = slice(r * 8, (r + 1) * 8)
        with tf.GradientTape() as tape:
            value = loss(y[rows], m(x[rows]))
        own = [np.array(g) for g in tape.gradient(value, m.trainable_variables)]
        with tf.GradientTape() as tape:
            value = loss(y[rows], m(x[rows]))
        opt.minimize(value, m.trainable_variables, tape=tape)
        everyone = hvd.allgather_object(own)
        mean = [np.mean([g[i] for g in everyone], axis=0) for i in range(len(own))]
        want = [w - 0.5 * (mean[i] if i < 2 else own[i] / n) for i, w in enumerate(start)]
        return weights(m), want

    def bad_input():
        v = tf.Variable(tf.ones([2 + r]))  # a different shape on each rank
        opt = hvd.DistributedOptimizer(make("sgd"))
        try:
            opt.apply_gradients([(tf.ones([2 + r]), v)])
            message = None
        except Exception as exc:  # the message is what is checked
            message = f"{type(exc).__name__}: {exc}"
        after = float(hvd.allreduce(tf.constant(float(r)), op=hvd.Sum))
        try:
            hvd.DistributedOptimizer("sgd")
            wrong_type = None
        except TypeError as exc:
            wrong_type = str(exc)
        return message, after, wrong_type

    sections = [(f"equivalence_{k}", equivalence(k)) for k in OPTIMIZERS]
    sections += [
        ("aggregation", equivalence("legacy_sgd", backward_passes_per_step=2, average_aggregated_gradients=True)),
        # sgd, not adam: skipped passes count `iterations` (Horovod), which Adam's bias correction reads
        ("aggregation_new", equivalence("sgd", backward_passes_per_step=2, average_aggregated_gradients=True)),
        # horovod.tensorflow.DistributedOptimizer hands a Keras optimizer to the Keras wrapper
        ("tensorflow_wrapper", equivalence("legacy_sgd", wrapper=__import__("hora.tensorflow").tensorflow
                                           .DistributedOptimizer)),
        ("custom_loop", custom_loop), ("horovod_hooks", horovod_hooks), ("callbacks", callbacks),
        ("load_model", load_model_round_trip), ("best_checkpoint", best_checkpoint), ("partial", partial),
        ("bad_input", bad_input),
        ("remove_out_dir", lambda: shutil.rmtree(out_dir)),
    ]
    return sections


JOB = shared_job(_job, 2, {"TF_USE_LEGACY_KERAS": "1"})


@pytest.fixture(scope="module")
def job(request) -> JobResults:
    return JOB.results(request)


def _check_equivalence(job: JobResults, section: str) -> None:
    (got0, want, start), (got1, _, _) = job.get(section, 0), job.get(section, 1)
    _close(got0, got1)
    _close(got0, want)
    assert not all(np.allclose(a, b, rtol=1e-3) for a, b in zip(got0, start)), "training moved nothing"


def _close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_two_workers_match_one_on_the_whole_batch(job, kind):
    _check_equivalence(job, f"equivalence_{kind}")


@pytest.mark.parametrize("section", ["aggregation", "aggregation_new", "tensorflow_wrapper"])
def test_backward_passes_per_step_match_one_worker_on_k_batches(job, section):
    _check_equivalence(job, section)


def test_apply_gradients_in_a_custom_loop_reduces(job):
    (got0, want), (got1, _) = job.get("custom_loop", 0), job.get("custom_loop", 1)
    _close(got0, got1)
    _close(got0, want)


def test_compute_gradients_hooks_and_sparse_as_dense(job):
    for rank in range(2):
        grad, grad_type, dense, name, is_sgd = job.get("horovod_hooks", rank)
        np.testing.assert_allclose(grad, [1.5, 1.5, 1.5])  # mean of 1 and 2
        assert grad_type != "IndexedSlices"
        # rows 0 and 1 were each looked up on one rank, row 4 on both: averages 0.5 and 1
        np.testing.assert_allclose(dense, [[0.5, 0.5], [0.5, 0.5], [0, 0], [0, 0], [1, 1], [0, 0]])
        assert name == "SGD" and is_sgd


def test_callbacks_on_a_tf_keras_model(job):
    (w0, lrs0, logged0), (w1, lrs1, logged1) = job.get("callbacks", 0), job.get("callbacks", 1)
    _close(w0, w1)  # broadcast from rank 0, then identical updates
    assert lrs0 == lrs1
    # warm-up from 0.2/2 to 0.2 over 2 epochs of 8 steps, set at each batch's begin (Horovod's formula,
    # which counts the batch as done so that the last batch of the last warm-up epoch runs at 0.2)
    want = [0.2 / 2 * ((e + (b + 1) / 8) * (2 - 1) / 2 + 1) for e in range(2) for b in range(8)]
    np.testing.assert_allclose(lrs0, want, rtol=1e-5)
    assert [m for m, _ in logged0] == [m for m, _ in logged1] == [0.5, 0.5]  # MetricAverageCallback: the mean
    np.testing.assert_allclose([lr for _, lr in logged0], [0.15, 0.2], rtol=1e-5)


def test_load_model_with_legacy_opts_round_trip(job):
    results = [job.get("load_model", rank) for rank in range(2)]
    for is_legacy_sgd, mixin, iterations, n_state, _, new_mixin in results:
        assert is_legacy_sgd and mixin == "_DistributedKeras2Optimizer" and new_mixin == "_DistributedKeras2Optimizer"
        assert iterations == 8  # 4 saved steps restored, then 4 more
        assert n_state == 5  # iterations and a momentum slot per weight, restored from the file
    _close(results[0][4], results[1][4])


def test_best_model_checkpoint_saves_on_rank_0_when_the_metric_improves(job):
    saves0, exists0, versions0, unset0 = job.get("best_checkpoint", 0)
    saves1, exists1, versions1, _ = job.get("best_checkpoint", 1)
    assert saves0 == 3 and versions0 >= 1 and all(exists0)  # epochs 0, 1 and 3 improved
    assert saves1 == 0 and not any(exists1)
    assert "rank 0" in unset0 and "filepath" in unset0


def test_partial_distributed_optimizer_keeps_local_layers_local(job):
    got0, want0 = job.get("partial", 0)
    got1, want1 = job.get("partial", 1)
    _close(got0, want0)
    _close(got1, want1)
    _close(got0[:2], got1[:2])  # the shared layer agrees
    assert not np.allclose(got0[2], got1[2])  # each rank's head is its own


def test_bad_input_gives_a_clear_error_naming_the_rank(job):
    for rank in range(2):
        message, after, wrong_type = job.get("bad_input", rank)
        assert message is not None and "rank" in message.lower() and "shape" in message.lower(), message
        assert after == 1.0  # the next collective works
        assert "tf_keras optimizer" in wrong_type and "str" in wrong_type


def test_keras_3_stays_the_default():
    from hora import keras_wrapper

    if os.environ.get("TF_USE_LEGACY_KERAS"):
        pytest.skip("this pytest process itself runs under TF_USE_LEGACY_KERAS")
    import keras

    assert not keras_wrapper.uses_tf_keras() and keras_wrapper.keras_api() is keras
