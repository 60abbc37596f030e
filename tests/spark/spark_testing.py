"""Real Spark for the tests: a local-mode session or a local-cluster one, shared by the modules that
need the same master (:class:`SharedSpark`, used by this folder's conftest).

Spark allows one SparkContext per process, so a session is stopped before one on another master
starts. The session's Python workers run this interpreter (``PYSPARK_PYTHON``) and inherit no hora
variables from this process; the web UI is off (start-up time), and the JVMs run with
:data:`JVM_OPTIONS` (the driver's take effect when this process starts its first session: it keeps
that JVM for later ones). ``local[2]`` gives 2 task slots in one JVM; ``local-cluster[2,1,1024]``
starts 2 executor JVMs of one core each on this machine, the nearest thing to a cluster that runs
here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from job_env import is_hora_variable

LOCAL = "local[2]"
LOCAL_CLUSTER = "local-cluster[2,1,1024]"
#: For the driver JVM and the executor JVMs: the tests run small jobs for a few minutes, where the
#: optimising JIT compiler (C2) and the parallel collector's threads cost far more CPU than they
#: win back (about 40% of the JVM's CPU in a test_data-sized run); C1 alone compiles the hot code.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


@contextlib.contextmanager
def spark_session(master: str = LOCAL, **conf: str) -> Iterator[Any]:
    """A SparkSession on ``master`` with ``conf``; stopped afterwards."""
    pyspark = pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):
            if is_hora_variable(key):
                patch.delenv(key)
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        patch.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
        builder = (SparkSession.builder.master(master).appName("hora-tests")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", "2")
                   .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
                   .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
                   .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
                   # One OpenMP thread per Python worker, as a task has one CPU (spark.task.cpus): torch's
                   # default of a thread per core in each of the two workers oversubscribes the cores,
                   # and its spinning threads burn CPU waiting for each other (the Keras estimator
                   # limits TensorFlow the same way itself).
                   .config("spark.executorEnv.OMP_NUM_THREADS", "1"))
        for key, value in conf.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        session.sparkContext.setLogLevel("ERROR")
        try:
            yield session
        finally:
            session.stop()
    del pyspark


class SharedSpark:
    """At most one open :func:`spark_session`, kept while callers ask for the same master and conf:
    a caller asking for another stops it and starts its own."""

    def __init__(self) -> None:
        self._key: tuple[str, tuple[tuple[str, str], ...]] | None = None
        self._context: contextlib.AbstractContextManager[Any] | None = None
        self._session: Any = None
        self._digits: tuple[Any, Any] | None = None

    def get(self, master: str, **conf: str) -> Any:
        key = (master, tuple(sorted(conf.items())))
        if key != self._key:
            self.close()
            context = spark_session(master, **conf)
            self._session = context.__enter__()
            self._context, self._key = context, key
        return self._session

    def digits(self, session: Any) -> Any:
        """scikit-learn's digits as ``features`` (64 pixels, 0-1) and ``label``, built once per session
        and cached: the estimator modules all train on it, and each of their many actions (the
        column checks, the Parquet write, ``transform``, ``count``) would otherwise re-run the Python
        job that turns the rows into Spark's."""
        if self._digits is None or self._digits[0] is not session:
            from sklearn.datasets import load_digits

            data = load_digits()
            rows = [(list(map(float, x / 16.0)), int(y)) for x, y in zip(data.data, data.target)]
            self._digits = (session, session.createDataFrame(rows, ["features", "label"]).cache())
        return self._digits[1]

    def close(self) -> None:
        self._digits = None
        context, self._context, self._key, self._session = self._context, None, None, None
        if context is not None:
            context.__exit__(None, None, None)


def run_example(module: str, argv: list[str], monkeypatch: Any) -> Any:
    """``main(argv)`` of ``examples/spark/<module>.py``, imported as the examples run (their folder
    on the path); the module is forgotten afterwards so the next test imports it afresh."""
    import importlib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.syspath_prepend(os.path.join(root, "examples", "spark"))
    try:
        return importlib.import_module(module).main(argv)
    finally:
        sys.modules.pop(module, None)
        sys.modules.pop("spark_digits", None)
