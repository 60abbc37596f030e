"""hora.keras on Keras 3's JAX backend (``KERAS_BACKEND=jax``), on 2 real workers.

The backend-neutral Keras checks of tests/hora_tensorflow/keras_sections.py, now with Keras's JAX trainer,
which compiles ``train_step`` with ``jax.jit``: the wrapped optimizer's gradients are averaged inside
the compiled step through one ordered host callback (hora.jax.keras_reducer). model.fit with
DistributedOptimizer must match 1 worker on the whole batches (SGD, Adam, groups, fp16,
gradient_predivide_factor), and the callbacks and load_model work. Each section compiles a fresh
train step (seconds each with XLA), so the job runs a subset of the shared sections: every wrapper
option once. backward_passes_per_step > 1 is refused on this backend (checked here).
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("keras")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hora_tensorflow"))

import keras_sections as ks
from job_env import SKIP_IMPORTS, TENSORFLOW_OPTIONAL_IMPORTS
from tf_job import JobResults, run_job

pytestmark = pytest.mark.timeout(600)


SECTIONS = ("keras.sgd", "keras.adam", "keras.groups", "keras.predivide", "keras.fp16", "callback.broadcast",
            "callback.metric_average", "callback.learning_rate", "load_model")


def _job() -> list:
    import keras
    import numpy as np

    import hora.keras as hvd

    def backend():
        return {"backend": keras.backend.backend()}

    def passes_refused():
        try:
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
            return None
        except NotImplementedError as exc:
            return str(exc)

    def warmup_within_epochs():
        # Per-batch learning-rate changes inside an epoch, where Keras's JAX trainer keeps the state
        # outside the variables (the callback syncs it): the rate must climb batch by batch, and the
        # weights stay equal on both ranks. (keras_sections' momentum probe reads variables
        # mid-epoch without a sync, which this backend does not allow, so it is not run here.)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        m.set_weights([np.random.default_rng(0).normal(0.0, 0.5, w.shape).astype(w.dtype) for w in m.get_weights()])
        m.compile(optimizer=opt, loss="mse")
        seen = []

        class Probe(keras.callbacks.Callback):
            def on_batch_begin(self, batch, logs=None):
                self.model.jax_state_sync()
                seen.append(float(np.asarray(keras.ops.convert_to_numpy(opt.learning_rate))))

        rng = np.random.default_rng(hvd.rank())
        m.fit(rng.normal(size=(16, 4)).astype(np.float32), np.zeros((16, 3), np.float32), batch_size=4, epochs=2,
              verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2, verbose=0), Probe()])
        return {"lr": seen, "weights": [np.asarray(w) for w in m.get_weights()]}

    chosen = [(name, fn) for name, fn in ks.keras_sections() if name in SECTIONS]
    assert [name for name, _ in chosen] == list(SECTIONS)
    return [("backend", backend), ("passes_refused", passes_refused), ("warmup", warmup_within_epochs)] + chosen


@pytest.fixture(scope="module")
def ranks2() -> JobResults:
    return run_job(_job, np=2, env={"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
                                    SKIP_IMPORTS: ",".join(n for n in TENSORFLOW_OPTIONAL_IMPORTS if n != "jax")})


def test_runs_on_the_jax_backend_2ranks(ranks2):
    for r in range(2):
        assert ranks2.get("backend", r) == {"backend": "jax"}


@pytest.mark.parametrize("section", ["keras.sgd", "keras.adam", "keras.groups", "keras.predivide"])
def test_fit_two_workers_match_one_worker_jax_backend_2ranks(ranks2, section):
    got = ks.check_equivalence(ranks2, section)
    assert got["iterations"] == ks.STEPS and got["is_instance"]


def test_fit_fp16_compression_jax_backend_2ranks(ranks2):
    ks.check_equivalence(ranks2, "keras.fp16", **ks.FP16_TOL)


def test_backward_passes_per_step_refused_on_jax_backend_2ranks(ranks2):
    for r in range(2):
        assert "not supported on Keras's JAX backend" in ranks2.get("passes_refused", r)


def test_callbacks_jax_backend_2ranks(ranks2):
    ks.check_broadcast_callback(ranks2)
    ks.check_metric_average(ranks2)
    ks.check_learning_rate_callbacks(ranks2)


def test_learning_rate_warmup_within_epochs_jax_backend_2ranks(ranks2):
    import numpy as np

    got = [ranks2.get("warmup", r) for r in range(2)]
    for r in range(2):
        np.testing.assert_allclose(got[r]["lr"], [0.4 * (0.5 + 0.5 * b / 8) for b in range(1, 9)], rtol=1e-6)
        for a, b in zip(got[r]["weights"], got[0]["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_load_model_jax_backend_2ranks(ranks2):
    ks.check_load_model(ranks2)
