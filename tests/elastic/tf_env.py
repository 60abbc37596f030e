"""The job environment of the TensorFlow and Keras elastic tests: tests/hora_tensorflow/tf_job.py's (TensorFlow
kept quiet and held to one compute thread per worker), reused rather than copied."""

from __future__ import annotations

import os
import sys

_TENSORFLOW_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hora_tensorflow")
if _TENSORFLOW_TESTS not in sys.path:
    sys.path.append(_TENSORFLOW_TESTS)

from tf_job import JobResults, TF_ENV, run_job as run_tf_job  # noqa: E402

__all__ = ["JobResults", "TF_ENV", "run_tf_job"]
