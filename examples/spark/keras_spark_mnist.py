"""Train a Keras model on a Spark DataFrame of handwritten digits with hora.spark.keras.KerasEstimator.

horovod.spark's Keras Estimator workflow on the digits data (scikit-learn's 1797 8x8 scans): the
pixels arrive as 64 numeric columns, a Spark ML Pipeline assembles them into one vector column and
the KerasEstimator trains a small Dense network on it; ``fit`` returns a PipelineModel whose last
stage is a KerasModel that predicts in Spark's executors. On this machine (a local Spark is started
for you; PySpark needs Java 17):

    pip install "hora[spark]" tensorflow scikit-learn
    python examples/spark/keras_spark_mnist.py --num-proc 2 --epochs 10

On a cluster, ``spark-submit examples/spark/keras_spark_mnist.py --work-dir <shared path>``: the
store (``--work-dir``) must be a path every executor reaches (a shared file system, ``hdfs://``, or
``dbfs:/`` on Databricks).

What ``fit`` does: it checks the columns, writes the DataFrame once as Parquet into the store, sends
the model to ``--num-proc`` Spark tasks as ``.keras`` bytes, and trains there with hora.keras (each
task reads its share of the Parquet row groups, gradients averaged by DistributedOptimizer), keeping
the per-epoch loss and accuracy (``getHistory()``) and checkpoints in the store.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from pyspark.ml import Pipeline
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession

from hora.spark.common.store import Store
from hora.spark.keras import KerasEstimator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spark_digits import digits_frame, held_out_accuracy, pixel_columns


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2, help="training processes (default: 2)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs (default: 10)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch, per process (default: 32)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (default: 0.01)")
    parser.add_argument("--master", default=None, help="Spark master when no session runs yet (default: local[N])")
    parser.add_argument("--work-dir", default=None, help="the store's path (default: a temporary directory)")
    return parser.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    spark = (SparkSession.builder.master(args.master or f"local[{args.num_proc}]")
             .appName("hora keras_spark_mnist").getOrCreate())
    df = digits_frame(spark)
    train_df, test_df = df.randomSplit([0.8, 0.2], seed=42)
    keras.utils.set_random_seed(42)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    with tempfile.TemporaryDirectory() as scratch:
        store = Store.create(args.work_dir or os.path.join(scratch, "store"))
        estimator = KerasEstimator(
            num_proc=args.num_proc, model=model, optimizer=keras.optimizers.Adam(args.lr),
            loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"], feature_cols=["features"],
            label_cols=["label"], validation=0.2, batch_size=args.batch_size, epochs=args.epochs, store=store,
            random_seed=42, verbose=1)
        assembler = VectorAssembler(inputCols=pixel_columns(), outputCol="features")
        began = time.perf_counter()
        fitted = Pipeline(stages=[assembler, estimator]).fit(train_df)
        fit_seconds = time.perf_counter() - began
    history = fitted.stages[-1].getHistory()
    test_accuracy, held_out = held_out_accuracy(fitted, test_df)
    print(f"KerasEstimator: {args.epochs} epoch(s) on {args.num_proc} process(es) in {fit_seconds:.1f} s; "
          f"validation accuracy {100.0 * history['val_accuracy'][-1]:.2f}%, test accuracy "
          f"{100.0 * test_accuracy:.2f}% on {held_out} held-out rows", flush=True)
    return test_accuracy


if __name__ == "__main__":
    main()
