"""Real Spark for the tests: a local-mode session (or a local-cluster one) per test module.

Spark allows one SparkContext per process, so each module starts its session in a module-scoped
fixture and stops it at the end. The session's Python workers run this interpreter
(``PYSPARK_PYTHON``) and inherit no hora variables from this process; the web UI is off (start-up
time). ``local[2]`` gives 2 task slots in one JVM; ``local-cluster[2,1,1024]`` starts 2 executor
JVMs of one core each on this machine, the nearest thing to a cluster that runs here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import pytest

from job_env import is_hora_variable

LOCAL = "local[2]"
LOCAL_CLUSTER = "local-cluster[2,1,1024]"


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
                   .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(p for p in sys.path if p)))
        for key, value in conf.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        session.sparkContext.setLogLevel("ERROR")
        try:
            yield session
        finally:
            session.stop()
    del pyspark


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
