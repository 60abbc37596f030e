"""The environment a job started from a test runs in.

Tests start real launchers and workers; whatever HORA_*/HOROVOD_* variables the shell running pytest
happens to have (a rank, a rendezvous address, a knob) must not leak into them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def is_hora_variable(name: str) -> bool:
    """Whether ``name`` is one of hora's identity or knob variables (or Horovod's alias of one)."""
    return name.startswith(("HORA_", "HOROVOD_"))


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without hora's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not is_hora_variable(k)}
    env.update(extra or {})
    return env


#: A job environment variable (comma-separated package names) read by ``tests/sections.py``: the job's
#: workers make importing those packages fail as if they were not installed (:func:`skip_imports`),
#: before anything imports TensorFlow.
SKIP_IMPORTS = "TESTS_SKIP_IMPORTS"

#: Packages TensorFlow and Keras import whenever they are installed, for features the binding tests
#: never use (tf.lite's JAX conversion, DataFrame inputs, plots, notebook detection), each behind a
#: ``try: ... except ImportError``: about a third of a TensorFlow worker's start-up CPU. scikit-learn
#: and SciPy are not among them: the Keras sections train on scikit-learn's digits.
TENSORFLOW_OPTIONAL_IMPORTS = ("jax", "pandas", "pyarrow", "matplotlib", "IPython")


def skip_imports(names: Sequence[str]) -> None:
    """In a worker: importing any of ``names`` now fails with ImportError, as if it were not installed
    (the libraries that try them carry on without). Never in the test process, whose other tests may
    use them; a package already imported stays."""
    for name in names:
        sys.modules.setdefault(name, None)
