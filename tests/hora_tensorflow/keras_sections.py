"""hora.keras checks that do not depend on the Keras backend, and the assertions that read them.

``keras_sections()`` runs inside a 2-rank job (on the TensorFlow backend in
test_keras_training.py, on the torch backend in test_keras_torch_backend.py); the ``check_*``
functions are the tests' side. The model is the Keras example's (examples/tensorflow2_keras_mnist.py,
without dropout so that runs are deterministic), trained on the first real digits.

The equivalence bar: the loss is a mean over the batch, so 2 workers that each take half of every
batch and average their gradients compute the whole batch's gradient, and must reach the weights
1 worker reaches on the whole batches (computed on rank 0 in the same job from the same start).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any

import numpy as np

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
BATCH = 16  # global batch: each of the 2 ranks takes 8 rows
STEPS = 4
TOL = dict(rtol=2e-4, atol=2e-5)
# float16 gradients carry ~3 significant digits; 4 momentum steps on them drift by up to ~1e-2 on
# weights of size ~0.3 (float32 runs agree to 1e-5)
FP16_TOL = dict(rtol=0, atol=2.5e-2)


def example():
    """The Keras example module (its model and data)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import tensorflow2_keras_mnist

    return tensorflow2_keras_mnist


def digits(rows: int) -> tuple[np.ndarray, np.ndarray]:
    train_x, train_y, _, _ = example().digits_arrays()
    return train_x[:rows], train_y[:rows]


def shard(x: np.ndarray, rank: int, size: int, batch: int) -> np.ndarray:
    """This rank's rows of every global batch of ``batch`` rows, in order."""
    per = batch // size
    return np.concatenate([x[s + rank * per: s + (rank + 1) * per] for s in range(0, len(x), batch)])


def keras_sections() -> list:
    import keras

    import hora.keras as hvd

    r, n = hvd.rank(), hvd.size()
    x, y = digits(BATCH * STEPS)

    def model(seed: int = 1):
        # Seeded from NumPy, not keras.utils.set_random_seed: that one imports TensorFlow whenever it
        # is installed, and the torch-backend job checks that nothing needs TensorFlow.
        m = example().build_model(dropout=False)
        rng = np.random.default_rng(seed)
        m.set_weights([rng.normal(0.0, 0.2, w.shape).astype(w.dtype) for w in m.get_weights()])
        return m

    def loss():
        return keras.losses.SparseCategoricalCrossentropy()

    def weights(m) -> list:
        return [np.array(w) for w in m.get_weights()]

    references: dict[str, tuple[list, list]] = {}

    def reference(key: str, make_opt, initial) -> list:
        """1 worker on whole batches: the weights the distributed runs must reach (rank 0 only).

        Every section that uses it starts from ``model()``'s weights (seeded, so always the same) and
        trains on the same batches, so the reference depends only on the optimizer: sections with
        the same plain optimizer (``key``) share one run instead of each compiling and fitting its own.
        """
        if r != 0:
            return []
        if key not in references:
            m = model()
            m.set_weights(initial)
            m.compile(optimizer=make_opt(), loss=loss())
            m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            references[key] = (initial, weights(m))
        start, reached = references[key]
        assert all(np.array_equal(a, b) for a, b in zip(start, initial)), "a shared reference from another start"
        return reached

    def sgd(lr=0.1):
        return keras.optimizers.SGD(lr, momentum=0.9)

    def equivalence(key: str, make_opt, options=lambda m: {}, **kwargs):
        def section():
            m = model()
            initial = weights(m)
            opt = hvd.DistributedOptimizer(make_opt(), **options(m), **kwargs)
            m.compile(optimizer=opt, loss=loss())
            m.fit(shard(x, r, n, BATCH), shard(y, r, n, BATCH), batch_size=BATCH // n, epochs=1, shuffle=False,
                  verbose=0)
            return {"weights": weights(m), "reference": reference(key, make_opt, initial),
                    "class": type(opt).__name__, "is_instance": isinstance(opt, type(make_opt())),
                    "iterations": int(np.asarray(keras.ops.convert_to_numpy(opt.iterations)))}
        return section

    def passes(k: int, average: bool):
        # k micro-batches per step, each a k-th of this rank's half batch. Averaged: the mean of the k
        # micro-batch gradients is the half batch's. Summed (Horovod's default): k times it, which for
        # SGD is the same as a k times larger learning rate.
        def section():
            m = model()
            initial = weights(m)
            opt = hvd.DistributedOptimizer(sgd(), backward_passes_per_step=k, average_aggregated_gradients=average)
            m.compile(optimizer=opt, loss=loss())
            m.fit(shard(x, r, n, BATCH), shard(y, r, n, BATCH), batch_size=BATCH // (n * k), epochs=1, shuffle=False,
                  verbose=0)
            lr = 0.1 if average else 0.1 * k
            return {"weights": weights(m), "reference": reference(f"sgd{lr}", lambda: sgd(lr), initial),
                    "iterations": int(np.asarray(keras.ops.convert_to_numpy(opt.iterations)))}
        return section

    class Recorder(keras.callbacks.Callback):
        """Records what other callbacks did: logs, learning rates, weights."""

        def __init__(self):
            super().__init__()
            self.train_begin_weights = None
            self.epoch_logs = []
            self.batch_lr = []

        def on_train_begin(self, logs=None):
            opt = self.model.optimizer
            self.train_begin_weights = weights(self.model) + [np.array(keras.ops.convert_to_numpy(v))
                                                              for v in opt.variables]

        def on_batch_begin(self, batch, logs=None):
            self.batch_lr.append(float(np.asarray(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))))

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_logs.append({k: float(v) for k, v in (logs or {}).items()})

    def broadcast_callback():
        m = model(seed=100 + r)  # different on every rank
        initial = weights(m)
        opt = hvd.DistributedOptimizer(sgd())
        m.compile(optimizer=opt, loss=loss())
        opt.build(m.trainable_variables)
        opt.momentums[0].assign(keras.ops.ones(opt.momentums[0].shape) * (r + 1))  # differing optimizer state
        after = Recorder()
        m.fit(shard(x, r, n, BATCH), shard(y, r, n, BATCH), batch_size=BATCH // n, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), after])
        # local_variables: each rank keeps its own values of those (here the first kernel)
        kept = model(seed=200 + r)
        kept.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss=loss())
        own = weights(kept)
        local = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=kept.weights[0])
        local.set_model(kept)
        local.on_train_begin()
        # after the broadcast, training from rank 0's start matches 1 worker from rank 0's start
        ref = []
        if r == 0:
            ref_model = model()
            ref_model.set_weights(initial)
            ref_opt = sgd()
            ref_model.compile(optimizer=ref_opt, loss=loss())
            ref_opt.build(ref_model.trainable_variables)
            ref_opt.momentums[0].assign(keras.ops.ones(ref_opt.momentums[0].shape))
            ref_model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            ref = weights(ref_model)
        return {"initial": initial, "at_train_begin": after.train_begin_weights, "weights": weights(m),
                "reference": ref, "local_own": own, "local_after": weights(kept)}

    shared: list = []

    def callback_model():
        """One compiled model for the callback sections, which read logged metrics, learning rates and
        momentum buffers, not where training leads: a fresh model per section would only cost another
        train-step trace (an XLA compile on the JAX backend). Each use starts from the optimizer's own
        rate, 0.05 (after fit the JAX trainer's state is back in the variables, so they are current)."""
        if not shared:
            m = model()
            opt = hvd.DistributedOptimizer(sgd(0.05))
            m.compile(optimizer=opt, loss=loss(), metrics=["accuracy"])
            shared.extend([m, opt])
        m, opt = shared
        opt.learning_rate = 0.05
        return m, opt

    def metric_average():
        m, _ = callback_model()
        raw = Recorder()  # before the averaging callback: sees this rank's own values
        rows = BATCH * STEPS // n
        history = m.fit(x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows], batch_size=BATCH // n, epochs=2,
                        shuffle=False, verbose=0, callbacks=[raw, hvd.callbacks.MetricAverageCallback()])
        return {"raw": raw.epoch_logs, "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}

    def learning_rate_callbacks():
        out = {}
        steps = STEPS  # batches per epoch: STEPS * 8 rows per rank, 8 at a time
        data = (shard(x, r, n, BATCH), shard(y, r, n, BATCH))
        cases = {
            "warmup": lambda: hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=2, verbose=1),
            "schedule": lambda: hvd.callbacks.LearningRateScheduleCallback(
                initial_lr=0.1, multiplier=lambda epoch: 0.5 ** epoch, start_epoch=1, end_epoch=3),
            "smooth": lambda: hvd.callbacks.LearningRateScheduleCallback(
                initial_lr=0.1, multiplier=lambda epoch: 1.0 / (1.0 + epoch), staircase=False, steps_per_epoch=steps),
            "constant": lambda: hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.3,
                                                                            start_epoch=2, staircase=False),
            "constant_stair": lambda: hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5,
                                                                                  start_epoch=1),
        }
        for label, make in cases.items():
            m, _ = callback_model()  # each case from the rate 0.05
            seen = Recorder()  # after the schedule: sees the rate each batch trains with
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                history = m.fit(*data, batch_size=BATCH // n, epochs=4, shuffle=False, verbose=0,
                                callbacks=[make(), seen])
            out[label] = {"batch_lr": seen.batch_lr, "epoch_lr": [float(v) for v in history.history["lr"]],
                          "printed": printed.getvalue()}
        return out

    def momentum_correction():
        # The momentum buffers are scaled by new_lr / old_lr when the rate changes (what Horovod's
        # temporary momentum change amounts to): read them just before and just after the schedule.
        m, opt = callback_model()
        opt.build(m.trainable_variables)  # so that the buffers exist from the first batch on (if not yet)

        class Buffers(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.values = []

            def on_batch_begin(self, batch, logs=None):
                self.values.append((float(np.asarray(keras.ops.convert_to_numpy(opt.learning_rate))),
                                    np.array(keras.ops.convert_to_numpy(opt.momentums[0]))))

        before, after = Buffers(), Buffers()
        schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda e: 0.5 ** e)
        m.fit(shard(x, r, n, BATCH), shard(y, r, n, BATCH), batch_size=BATCH // n, epochs=3, shuffle=False,
              verbose=0, callbacks=[before, schedule, after])
        return {"before": before.values, "after": after.values}

    def save_and_load_model():
        import tempfile

        m = model()
        m.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss=loss())
        m.fit(shard(x, r, n, BATCH)[:8], shard(y, r, n, BATCH)[:8], batch_size=8, epochs=1, verbose=0)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            m.save(path)
            plain = keras.models.load_model(path)
            loaded = hvd.load_model(path, compression=hvd.Compression.fp16)
        opt = loaded.optimizer
        saved_iterations = int(np.asarray(keras.ops.convert_to_numpy(opt.iterations)))
        same_momentum = np.allclose(keras.ops.convert_to_numpy(opt.momentums[0]),
                                    keras.ops.convert_to_numpy(m.optimizer.momentums[0]))
        # Different data on each rank: only averaged gradients keep the replicas equal.
        loaded.fit(x[r * 8:(r + 1) * 8], y[r * 8:(r + 1) * 8], batch_size=8, epochs=1, verbose=0)
        return {"class": type(opt).__name__, "distributed": hasattr(opt, "_hora"),
                "plain_distributed": hasattr(plain.optimizer, "_hora"), "saved_iterations": saved_iterations,
                "same_momentum": bool(same_momentum), "weights": weights(loaded)}

    def mixed_precision():
        # Under mixed_float16 the loss-scale check must see the averaged gradients: rank 1's second
        # batch overflows float16 (rank 0's never does), and both ranks skip that step together.
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
            m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
                      jit_compile=False)
            x = np.full((4, 2), 0.1, np.float32)  # scaled gradients stay inside float16 ...
            if r == 1:
                x[1] = 300.0  # ... except these
            m.fit(x, np.zeros((4, 1), np.float32), batch_size=1, epochs=1, verbose=0, shuffle=False)
            return {"class": type(m.optimizer).__name__, "distributed": hasattr(m.optimizer, "_hora"),
                    "iterations": int(np.asarray(keras.ops.convert_to_numpy(m.optimizer.iterations))),
                    "weights": weights(m)}
        finally:
            keras.mixed_precision.set_global_policy("float32")

    return [
        ("keras.sgd", equivalence("sgd0.1", sgd)),
        ("keras.adam", equivalence("adam", lambda: keras.optimizers.Adam(0.01))),
        ("keras.groups", equivalence("sgd0.1", sgd, groups=2)),
        ("keras.groups_lists", equivalence("sgd0.1", sgd, lambda m: {"groups": [m.trainable_variables[0::2],
                                                                                m.trainable_variables[1:4:2]]})),
        ("keras.num_groups", equivalence("sgd0.1", sgd, num_groups=3)),
        ("keras.predivide", equivalence("sgd0.1", sgd, gradient_predivide_factor=2.0)),
        ("keras.fp16", equivalence("sgd0.1", sgd, compression=hvd.Compression.fp16)),
        ("keras.passes2.average", passes(2, True)),
        ("keras.passes2.sum", passes(2, False)),
        ("keras.passes4.average", passes(4, True)),
        ("callback.broadcast", broadcast_callback),
        ("callback.metric_average", metric_average),
        ("callback.learning_rate", learning_rate_callbacks),
        ("callback.momentum_correction", momentum_correction),
        ("mixed_precision", mixed_precision),
        ("load_model", save_and_load_model),  # last: saving imports TensorFlow on any backend
    ]


# ---- the tests' side -------------------------------------------------------------------------------


def assert_close_lists(got: list, want: list, **tol: Any) -> None:
    assert len(got) == len(want) and got
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, **(tol or TOL))


def check_equivalence(job, section: str, **tol: Any) -> dict:
    """Both ranks hold identical weights, equal (within float tolerance) to rank 0's 1-worker reference."""
    ranks = job.all(section)
    for got in ranks[1:]:
        for a, b in zip(ranks[0]["weights"], got["weights"]):
            np.testing.assert_array_equal(a, b, err_msg=f"{section}: ranks disagree")
    assert_close_lists(ranks[0]["weights"], ranks[0]["reference"], **tol)
    return ranks[0]


def check_broadcast_callback(job) -> None:
    root_initial = job.get("callback.broadcast", 0)["initial"]
    other_initial = job.get("callback.broadcast", 1)["initial"]
    assert not np.array_equal(root_initial[0], other_initial[0])  # they did start apart
    states = [job.get("callback.broadcast", r)["at_train_begin"] for r in range(2)]
    for a, b in zip(states[0], states[1]):
        np.testing.assert_array_equal(a, b)  # weights and optimizer state identical before step 1
    assert_close_lists(states[1][: len(root_initial)], root_initial, rtol=0, atol=0)
    check_equivalence(job, "callback.broadcast")
    root_own = job.get("callback.broadcast", 0)["local_own"]
    for r in range(2):
        got = job.get("callback.broadcast", r)
        assert not np.array_equal(got["local_own"][0], job.get("callback.broadcast", 1 - r)["local_own"][0])
        np.testing.assert_array_equal(got["local_after"][0], got["local_own"][0])  # kept its own
        assert_close_lists(got["local_after"][1:], root_own[1:], rtol=0, atol=0)  # the rest: the root's


def check_metric_average(job) -> None:
    raw = [job.get("callback.metric_average", r)["raw"] for r in range(2)]
    assert raw[0][0]["loss"] != raw[1][0]["loss"]  # different data: different local metrics
    for r in range(2):
        history = job.get("callback.metric_average", r)["history"]
        for name in ("loss", "accuracy"):
            want = [(raw[0][e][name] + raw[1][e][name]) / 2 for e in range(2)]
            np.testing.assert_allclose(history[name], want, rtol=1e-6)


def warmup_lr(epoch: int, batch: int, steps: int, initial: float = 0.2, warmup: int = 2, size: int = 2) -> float:
    """Horovod's warm-up: initial / size at the start, initial after ``warmup`` epochs, linear per batch."""
    e = min(epoch + batch / steps + 1.0 / steps, warmup)
    return initial / size * (e * (size - 1) / warmup + 1)


def check_learning_rate_callbacks(job, steps: int = STEPS) -> None:
    for r in range(2):
        got = job.get("callback.learning_rate", r)
        batches = [(e, b) for e in range(4) for b in range(steps)]
        warm = [warmup_lr(e, b, steps) if e < 2 else 0.2 for e, b in batches]
        np.testing.assert_allclose(got["warmup"]["batch_lr"], warm, rtol=1e-6)
        assert got["warmup"]["batch_lr"][0] == pytest_approx(0.1 + 0.1 / (2 * steps))
        np.testing.assert_allclose(got["warmup"]["epoch_lr"], [warmup_lr(e, steps - 1, steps) for e in range(2)]
                                   + [0.2, 0.2], rtol=1e-6)
        # staircase, epochs 1 and 2 only: the optimizer's own 0.05 before, the last value after
        stair = {0: 0.05, 1: 0.05, 2: 0.025, 3: 0.025}
        np.testing.assert_allclose(got["schedule"]["batch_lr"], [stair[e] for e, _ in batches], rtol=1e-6)
        smooth = [0.1 / (1.0 + e + b / steps) for e, b in batches]
        np.testing.assert_allclose(got["smooth"]["batch_lr"], smooth, rtol=1e-6)
        # a constant multiplier is exponential decay from start_epoch (as in Horovod), here per batch
        decay = [0.05 if e < 2 else 0.1 * 0.3 ** (e + b / steps - 2) for e, b in batches]
        np.testing.assert_allclose(got["constant"]["batch_lr"], decay, rtol=1e-6)
        # ... and with the default staircase, once per epoch: 0.1 * 0.5 ** (epoch - 1) from epoch 1 on
        stairs = {0: 0.05, 1: 0.1, 2: 0.05, 3: 0.025}
        np.testing.assert_allclose(got["constant_stair"]["batch_lr"], [stairs[e] for e, _ in batches], rtol=1e-6)
        assert got["constant_stair"]["epoch_lr"] == pytest_approx([0.05, 0.1, 0.05, 0.025])
        # verbose warm-up says when it ends, once: on rank 0
        said = got["warmup"]["printed"]
        assert ("finished gradual learning rate warmup" in said) == (r == 0), said


def pytest_approx(value: float):
    import pytest

    return pytest.approx(value, rel=1e-6)


def check_momentum_correction(job, steps: int = STEPS) -> None:
    for r in range(2):
        got = job.get("callback.momentum_correction", r)
        for (lr_before, m_before), (lr_after, m_after) in zip(got["before"], got["after"]):
            if lr_before == lr_after:
                np.testing.assert_array_equal(m_after, m_before)
            else:
                np.testing.assert_allclose(m_after, m_before * (lr_after / lr_before), rtol=1e-6)
        changes = [i for i, ((a, _), (b, _)) in enumerate(zip(got["before"], got["after"])) if a != b]
        assert changes == [0, steps, 2 * steps]  # 0.05 -> 0.1 -> 0.05 -> 0.025 at each epoch's start
        assert np.any(got["before"][steps][1])  # the buffers were non-zero when scaled


def check_load_model(job) -> None:
    ranks = job.all("load_model")
    for got in ranks:
        assert got["class"] == "SGD" and got["distributed"] and not got["plain_distributed"]
        assert got["saved_iterations"] == 1 and got["same_momentum"]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        np.testing.assert_array_equal(a, b)


def check_mixed_precision(job) -> None:
    got = [job.get("mixed_precision", r) for r in range(2)]
    for g in got:
        assert g["class"] == "LossScaleOptimizer" and g["distributed"]
        assert g["iterations"] == 3  # 4 batches, the overflowing one skipped on both ranks
    assert_close_lists(got[0]["weights"], got[1]["weights"], rtol=0, atol=0)
