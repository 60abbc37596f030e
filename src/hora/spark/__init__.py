"""hora on Spark: horovod.spark's ``run`` (hora's workers as the tasks of a Spark barrier stage) and
``run_elastic`` (workers in long-running Spark tasks, re-formed when executors come and go).

``import hora.spark`` replaces ``import horovod.spark``; see docs/spark.md. Needs PySpark 4 and
pyarrow: ``pip install "hora[spark]"``.
"""

try:
    import pyspark  # noqa: F401 - only to say what is missing
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('hora.spark needs PySpark, which is not installed: pip install "hora[spark]"') from exc

from hora.spark.elastic import run_elastic
from hora.spark.runner import run

__all__ = ["run", "run_elastic"]
