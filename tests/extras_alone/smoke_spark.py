"""The spark extra alone, on a local Spark (master local[2]) started here; run as plain
``python smoke_spark.py`` (Spark, not ``hora run``, starts the workers).

Two things the extra must be enough for:
1. ``hora.spark.run`` runs a 2-rank hora job in the tasks of a Spark barrier stage;
2. ``DataFrame.mapInArrow`` with a function over pyarrow record batches, the way the estimators'
   ``transform`` adds its output columns. Spark refuses mapInArrow without pandas, which the extra
   once forgot to declare: ``hora[spark]`` alone could train but not transform.
The estimators' shared module is imported too, so a framework-free import it might grow is caught.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

from pyspark.sql import SparkSession
from smoke_report import report  # this folder: on the path of a script run from it

import hora.spark
import hora.spark.common.estimator  # importable with the spark extra alone


def reduce_on_each_task() -> dict[str, Any]:
    import numpy as np

    import hora

    hora.init()
    summed = hora.allreduce(np.array([1.0 + hora.rank(), 10.0]), op=hora.Sum, name="smoke.sum")
    return {"rank": hora.rank(), "size": hora.size(), "sum": summed.tolist()}


def doubled(batches: Iterator[Any]) -> Iterator[Any]:
    """What an estimator's transform does, without a model: one output column computed per batch."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for batch in batches:
        out = pc.multiply(batch.column("x"), 2.0)
        yield pa.RecordBatch.from_arrays(list(batch.columns) + [out], names=batch.schema.names + ["x__output"])


#: The JVM's options: a smoke of a few small jobs, where the optimising JIT compiler (C2) and the
#: parallel collector's threads cost far more CPU than they win back (as in tests/spark).
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def main() -> None:
    spark = (SparkSession.builder.master("local[2]").appName("hora extras smoke")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        results = hora.spark.run(reduce_on_each_task, num_proc=2, start_timeout=120, verbose=0)
        df = spark.createDataFrame([(float(i),) for i in range(1, 7)], "x double")  # 2 partitions: local[2]
        transformed = df.mapInArrow(doubled, "x double, x__output double")
        rows = sorted((row.x, row.x__output) for row in transformed.collect())
    finally:
        spark.stop()
    for result in results:
        report(result)
    report({"transform": rows})


if __name__ == "__main__":
    main()
