"""The Spark session of a test module: local mode with 2 task slots, started once per module (Spark
allows one SparkContext per process) and stopped when the module's tests are done. A module that
needs another master (local-cluster) defines its own fixture."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from spark_testing import LOCAL, spark_session


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    with spark_session(LOCAL) as session:
        yield session
