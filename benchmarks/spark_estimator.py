#!/usr/bin/env python
"""How long ``TorchEstimator.fit`` takes on Spark, and the same training under ``hora.run``.

One run on the digits data (scikit-learn's 1797 8x8 scans as a DataFrame, features an array column,
20% validation), a 64-64-10 network, SGD, ``--epochs`` epochs on ``--num-proc`` processes:

1. ``fit``: ``TorchEstimator(...).fit(df)`` end to end on a local Spark with ``--num-proc`` task
   slots: the checks, writing the Parquet copy, training in Spark tasks, building the model;
2. its parts, run one after the other outside ``fit``: ``write`` (the checks and the Parquet
   copy), ``spark`` (the training function in ``hora.spark.run``);
3. ``hora.run``: the very same training function (same data, model, optimizer, steps) started by
   ``hora.run`` as plain processes, reading the same Parquet files.

Both calls are timed as a whole, and inside the workers: each worker runs the training function
twice and times the second run, since ``hora.run`` starts fresh Python processes (importing torch)
while Spark's Python workers are warm after the ``fit``; the in-worker ratio compares the training
itself.
Machines are shared and noisy: compare the ratios of one run.

    python benchmarks/spark_estimator.py                  # 10 epochs, 2 processes
    python benchmarks/spark_estimator.py --epochs 5 --repeat 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any


def _digits(spark: Any) -> Any:
    from sklearn.datasets import load_digits

    data = load_digits()
    rows = [(list(map(float, x / 16.0)), int(y)) for x, y in zip(data.data, data.target)]
    return spark.createDataFrame(rows, ["features", "label"])


def _estimator(store: Any, epochs: int, num_proc: int) -> Any:
    import torch

    from hora.spark.torch import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return TorchEstimator(num_proc=num_proc, model=model,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                          loss=torch.nn.functional.cross_entropy, feature_cols=["features"],
                          label_cols=["label"], validation=0.2, batch_size=32, epochs=epochs, store=store,
                          random_seed=7, verbose=0, keep_intermediate_data=True)


def measure(spark: Any, epochs: int, num_proc: int, folder: str) -> dict[str, float]:
    import hora
    import hora.spark
    from hora.spark.common import data as spark_data
    from hora.spark.common.estimator import TrainingJob
    from hora.spark.common.store import Store

    df = _digits(spark).cache()
    df.count()
    store = Store.create(os.path.join(folder, f"store-{time.time_ns()}"))

    began = time.perf_counter()
    fitted = _estimator(store, epochs, num_proc).fit(df)
    fit_s = time.perf_counter() - began
    accuracy = fitted.getHistory().get("val_loss", [float("nan")])[-1]

    estimator = _estimator(store, epochs, num_proc)
    began = time.perf_counter()
    schema = spark_data.check_and_describe(df, ["features"], ["label"], None, 0.2)
    index = store.new_dataset_index()
    info = spark_data.write_training_data(store, df, schema, 0.2, index, num_partitions=num_proc * 10, random_seed=7)
    write_s = time.perf_counter() - began
    job = TrainingJob(store=store, info=info, run_id="bench", num_proc=num_proc, epochs=epochs, batch_size=32,
                      seed=7, verbose=0, params=estimator)
    trainer = estimator._training_function(job)

    def timed() -> tuple[Any, float]:
        """The training function twice in the worker: the first call warms the process up (imports,
        first allocations: Spark's workers are warm already, hora.run's are new); the second is timed."""
        trainer()
        start = time.perf_counter()
        result = trainer()
        return result, time.perf_counter() - start

    began = time.perf_counter()
    spark_results = hora.spark.run(timed, num_proc=num_proc, verbose=0)
    spark_s = time.perf_counter() - began
    began = time.perf_counter()
    # One thread per process, as Spark gives its Python workers (OMP_NUM_THREADS = spark.task.cpus).
    run_results = hora.run(timed, np=num_proc, env={"OMP_NUM_THREADS": "1"})
    run_s = time.perf_counter() - began
    # The histories: same data, same steps, same numbers.
    same = spark_results[0][0][1] == run_results[0][0][1]
    store.remove_data(index)
    spark_train = max(seconds for _, seconds in spark_results)
    run_train = max(seconds for _, seconds in run_results)
    return {"fit_s": fit_s, "write_s": write_s, "spark_s": spark_s, "hora_run_s": run_s,
            "spark_train_s": spark_train, "hora_run_train_s": run_train,
            "train_ratio": spark_train / run_train, "val_loss": accuracy, "same_history": float(same)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="measurements (the median is printed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per measurement")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{args.num_proc}]").appName("hora spark_estimator benchmark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(args.repeat):
                row = measure(spark, args.epochs, args.num_proc, folder)
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    finally:
        spark.stop()
    if not args.json:
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(f"TorchEstimator on digits, {args.epochs} epochs, {args.num_proc} processes (median of {len(rows)}):")
        print(f"  fit, end to end        {med['fit_s']:7.2f} s")
        print(f"  checks + Parquet write {med['write_s']:7.2f} s")
        print(f"  training in Spark tasks {med['spark_s']:6.2f} s call, {med['spark_train_s']:.2f} s in the workers")
        print(f"  same training, hora.run {med['hora_run_s']:6.2f} s call, "
              f"{med['hora_run_train_s']:.2f} s in the workers")
        print(f"  in-worker Spark / hora.run = {med['train_ratio']:.2f}; identical history: "
              f"{bool(med['same_history'])} (the calls include start-up; the workers' times are warm runs)")


if __name__ == "__main__":
    main()
