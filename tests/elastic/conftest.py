"""The 2-rank jobs shared by several test modules of this folder (see shared_jobs.py for why).

Session-scoped: the first test that needs a job starts it, and every later module reads the same
results. (Helpers live in shared_jobs.py: several test folders have a ``conftest`` module.)
"""

from __future__ import annotations

import pytest
import shared_jobs
from sections import JobResults
from tf_env import run_tf_job


@pytest.fixture(scope="session")
def tensorflow_job() -> JobResults:
    """test_tensorflow_elastic.py's sections, then Keras-on-TensorFlow's of test_keras_elastic.py."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    return run_tf_job(shared_jobs.tensorflow_sections, np=2, env={"KERAS_BACKEND": "tensorflow"})


@pytest.fixture(scope="session")
def torch_job() -> JobResults:
    """test_torch_elastic.py's sections, then Keras-on-torch's of test_keras_elastic.py."""
    pytest.importorskip("torch")
    return run_tf_job(shared_jobs.torch_sections, np=2, env={"KERAS_BACKEND": "torch"})
