"""The job environment of the TensorFlow and Keras elastic tests: tests/hora_tensorflow/tf_job.py's (TensorFlow
kept quiet and held to one compute thread per worker), reused rather than copied, and the optional imports
their workers go without."""

from __future__ import annotations

import os
import sys

_TENSORFLOW_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hora_tensorflow")
if _TENSORFLOW_TESTS not in sys.path:
    sys.path.append(_TENSORFLOW_TESTS)

from job_env import skip_imports  # noqa: E402
from tf_job import TF_ENV, JobResults, run_job as run_tf_job  # noqa: E402

#: Packages that TensorFlow and Keras import whenever they are installed, for features no elastic test
#: uses (tf.lite's JAX conversion, DataFrame inputs, plots, the scikit-learn wrappers, notebook
#: detection), each behind a ``try: ... except ImportError``. Importing them costs a worker about 3 s
#: of CPU, a third of its start-up. (Not every such import is optional: TensorFlow needs ``requests``.)
OPTIONAL_IMPORTS = ("jax", "pandas", "pyarrow", "matplotlib", "sklearn", "scipy", "IPython")


def skip_optional_imports() -> None:
    """In a worker, before it imports TensorFlow or Keras: make importing OPTIONAL_IMPORTS fail as if
    they were not installed (each library catches that ImportError). Never in the test process, whose
    other tests may use them."""
    skip_imports(OPTIONAL_IMPORTS)


__all__ = ["JobResults", "TF_ENV", "run_tf_job", "skip_optional_imports"]
