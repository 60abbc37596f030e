"""hora.keras on Keras 3's torch backend (``KERAS_BACKEND=torch``), on 2 real workers.

The same backend-neutral checks as on TensorFlow (keras_sections.py): model.fit with
DistributedOptimizer matches 1 worker on the whole batches, backward_passes_per_step, the callbacks
and load_model. On this backend Keras runs the train step eagerly and hora reduces the gradients
through NumPy; hora never imports TensorFlow there (checked).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("keras")

import keras_sections as ks
from tf_job import JobResults, run_job

pytestmark = pytest.mark.timeout(240)


def _job() -> list:
    import sys

    import keras

    def backend():
        return {"backend": keras.backend.backend(), "tensorflow_imported": "tensorflow" in sys.modules,
                "torch_imported": "torch" in sys.modules}

    # Keras itself imports TensorFlow, when installed, in model.save and keras.utils.set_random_seed:
    # the check after training comes before the saving section (last), and the sections seed from NumPy.
    sections = ks.keras_sections()
    assert sections[-1][0] == "load_model"
    return [("backend", backend)] + sections[:-1] + [("backend.after", backend), sections[-1]]


@pytest.fixture(scope="module")
def ranks2() -> JobResults:
    return run_job(_job, np=2, env={"KERAS_BACKEND": "torch"})


def test_runs_on_the_torch_backend_without_tensorflow_2ranks(ranks2):
    for r in range(2):
        for section in ("backend", "backend.after"):
            assert ranks2.get(section, r) == {"backend": "torch", "tensorflow_imported": False, "torch_imported": True}


def test_hora_keras_on_the_torch_backend_never_imports_tensorflow(ranks2):
    """``import hora.keras, keras`` under KERAS_BACKEND=torch loads torch, never TensorFlow. Read in the
    workers before any training (section "backend"): they have imported hora.keras and keras, and
    more besides (this module, pytest, NumPy), so no TensorFlow there means no TensorFlow after those
    two imports alone; a fresh interpreter for it would import torch and Keras once more."""
    for r in range(2):
        got = ranks2.get("backend", r)
        assert got["backend"] == "torch" and got["torch_imported"] and not got["tensorflow_imported"]


@pytest.mark.parametrize("section", ["keras.sgd", "keras.adam", "keras.groups", "keras.groups_lists",
                                     "keras.num_groups", "keras.predivide"])
def test_fit_two_workers_match_one_worker_torch_backend_2ranks(ranks2, section):
    got = ks.check_equivalence(ranks2, section)
    assert got["iterations"] == ks.STEPS and got["is_instance"]


def test_fit_fp16_compression_torch_backend_2ranks(ranks2):
    ks.check_equivalence(ranks2, "keras.fp16", **ks.FP16_TOL)


@pytest.mark.parametrize("section,k", [("keras.passes2.average", 2), ("keras.passes2.sum", 2),
                                       ("keras.passes4.average", 4)])
def test_backward_passes_per_step_torch_backend_2ranks(ranks2, section, k):
    assert ks.check_equivalence(ranks2, section)["iterations"] == ks.STEPS * k


def test_callbacks_torch_backend_2ranks(ranks2):
    ks.check_broadcast_callback(ranks2)
    ks.check_metric_average(ranks2)
    ks.check_learning_rate_callbacks(ranks2)
    ks.check_momentum_correction(ranks2)


def test_load_model_torch_backend_2ranks(ranks2):
    ks.check_load_model(ranks2)


def test_mixed_precision_torch_backend_2ranks(ranks2):
    ks.check_mixed_precision(ranks2)
