"""The Spark sessions of this folder: one local-mode session (2 task slots) shared by every module
that asks for ``spark``, and one local-cluster session (two executor JVMs) shared by the modules
that ask for ``spark_cluster``.

Spark allows one SparkContext per process, and starting one is among the slowest things these tests
do: the context itself, then its Python workers, each importing torch or TensorFlow again on its
first task. So a session is kept for as long as the next test wants the same master, and the
modules of this folder run grouped by the master they need (local first, then local-cluster), so
each master starts once per run. The last session is stopped when the last test of this folder is
done, so no Spark outlives the folder in a full run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from spark_testing import LOCAL, LOCAL_CLUSTER, SharedSpark

_HERE = os.path.dirname(os.path.abspath(__file__))
_SESSIONS = SharedSpark()

#: What the local-cluster modules need: Spark's default for a cluster made explicit (a lost
#: executor's task is retried, which is what the elastic tests recover through).
CLUSTER_CONF = {"spark.task.maxFailures": "4"}


@pytest.fixture(scope="module")
def spark() -> Any:
    return _SESSIONS.get(LOCAL)


@pytest.fixture(scope="module")
def spark_cluster() -> Any:
    """The local-cluster session, with both executors registered: they register after the session
    starts, and a previous module may have killed one (the cluster then starts another)."""
    import hora.spark

    session = _SESSIONS.get(LOCAL_CLUSTER, **CLUSTER_CONF)
    deadline = time.monotonic() + 120
    while hora.spark.runner.task_slots(session.sparkContext) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return session


@pytest.fixture(scope="module")
def digits_frame(spark: Any) -> Any:
    """The digits DataFrame the estimator modules share (see :meth:`SharedSpark.digits`)."""
    pytest.importorskip("sklearn")
    return _SESSIONS.digits(spark)


def _in_this_folder(item: pytest.Item | None) -> bool:
    return item is not None and os.path.dirname(os.path.abspath(str(item.path))) == _HERE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This folder's modules grouped by master, local-cluster ones last (order kept otherwise), in
    the places this folder's tests had in the run."""
    places = [index for index, item in enumerate(items) if _in_this_folder(item)]
    cluster_modules = {items[index].path for index in places
                       if "spark_cluster" in getattr(items[index], "fixturenames", ())}
    ordered = sorted((items[index] for index in places), key=lambda item: item.path in cluster_modules)
    for index, item in zip(places, ordered):
        items[index] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After this folder's last test (its module fixtures finalised first), stop the session."""
    if not _in_this_folder(nextitem):
        _SESSIONS.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _SESSIONS.close()  # a run that stopped early (-x, Ctrl-C)
