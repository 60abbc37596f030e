"""Train a PyTorch model on a Spark DataFrame of handwritten digits with hora.spark.torch.TorchEstimator.

horovod.spark's Estimator workflow on the digits data (scikit-learn's 1797 8x8 scans): the pixels
arrive as 64 numeric columns, a Spark ML Pipeline assembles them into one vector column and the
TorchEstimator trains the network on it; ``fit`` returns a PipelineModel whose last stage is a
TorchModel that predicts in Spark's executors. On this machine (a local Spark is started for you;
PySpark needs Java 17):

    pip install "hora[spark]" torch scikit-learn
    python examples/spark/pytorch_spark_mnist.py --num-proc 2 --epochs 10

On a cluster, ``spark-submit examples/spark/pytorch_spark_mnist.py --work-dir <shared path>``: the
store (``--work-dir``) must be a path every executor reaches (a shared file system, ``hdfs://``,
or ``dbfs:/`` on Databricks).

What ``fit`` does: it checks the columns, writes the DataFrame once as Parquet into the store, trains
on ``--num-proc`` Spark tasks (each a hora.torch worker reading its share of the Parquet row groups
through a shuffle buffer, gradients averaged by DistributedOptimizer), records the per-epoch loss and
accuracy (``getHistory()``) and checkpoints into the store.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from pyspark.ml import Pipeline
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession

from hora.spark.common.store import Store
from hora.spark.torch import TorchEstimator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spark_digits import digits_frame, held_out_accuracy, pixel_columns


class Net(torch.nn.Module):
    """The digits network: 64 pixels, one hidden layer, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def accuracy(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == label).float().mean()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2, help="training processes (default: 2)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs (default: 10)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch, per process (default: 32)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default: 0.1)")
    parser.add_argument("--master", default=None, help="Spark master when no session runs yet (default: local[N])")
    parser.add_argument("--work-dir", default=None, help="the store's path (default: a temporary directory)")
    return parser.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    spark = (SparkSession.builder.master(args.master or f"local[{args.num_proc}]")
             .appName("hora pytorch_spark_mnist").getOrCreate())
    df = digits_frame(spark)
    train_df, test_df = df.randomSplit([0.8, 0.2], seed=42)
    with tempfile.TemporaryDirectory() as scratch:
        store = Store.create(args.work_dir or os.path.join(scratch, "store"))
        torch.manual_seed(42)
        model = Net()
        estimator = TorchEstimator(
            num_proc=args.num_proc, model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
            loss=torch.nn.functional.cross_entropy, metrics=[accuracy], feature_cols=["features"],
            label_cols=["label"], validation=0.2, batch_size=args.batch_size, epochs=args.epochs, store=store,
            random_seed=42, verbose=1)
        assembler = VectorAssembler(inputCols=pixel_columns(), outputCol="features")
        began = time.perf_counter()
        fitted = Pipeline(stages=[assembler, estimator]).fit(train_df)
        fit_seconds = time.perf_counter() - began
    history = fitted.stages[-1].getHistory()
    test_accuracy, held_out = held_out_accuracy(fitted, test_df)
    print(f"TorchEstimator: {args.epochs} epoch(s) on {args.num_proc} process(es) in {fit_seconds:.1f} s; "
          f"validation accuracy {100.0 * history['val_accuracy'][-1]:.2f}%, test accuracy "
          f"{100.0 * test_accuracy:.2f}% on {held_out} held-out rows", flush=True)
    return test_accuracy


if __name__ == "__main__":
    main()
