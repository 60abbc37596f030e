"""Data-parallel training on handwritten digits with hora.torch, in the tasks of a Spark job.

examples/pytorch_mnist.py (the same network, the same digits data: scikit-learn's 1797 8x8 scans,
split 80/20, the same training steps) run by ``hora.spark.run`` the way horovod.spark's ``run``
runs a Horovod function. On this machine (a local Spark with one task slot per worker is started for
you; PySpark needs Java 17):

    pip install "hora[spark]" torch scikit-learn
    python examples/spark/spark_run.py --num-proc 2 --epochs 3

On a Spark cluster, submit it with ``spark-submit --master <cluster> examples/spark/spark_run.py
--num-proc N``: the session it finds is the cluster's. Flags other than ``--num-proc``,
``--master`` and ``--start-timeout`` are examples/pytorch_mnist.py's training flags.

What happens:
1. ``hora.spark.run(pytorch_mnist.main, args=[training flags], num_proc=N)`` runs a one-stage Spark
   job of N tasks in barrier mode: Spark starts them together, each task takes its rank from where
   Spark placed it (tasks on one machine share memory), and the driver serves the job's rendezvous;
2. every task calls the training script's ``main`` unchanged: ``hvd.init()`` joins the job, the
   script shards the data, wraps the optimizer and trains; rank 0's progress lines come back to this
   terminal prefixed ``[0]<stdout>:``;
3. ``run`` returns what ``main`` returned on each rank (the test accuracy), in rank order.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pyspark.sql import SparkSession

import hora.spark

# The training script the tasks run; they import it too (hora.spark.run gives them this import path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pytorch_mnist


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str], argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Every other flag is a training flag of examples/pytorch_mnist.py: --epochs, --batch-size, "
               "--lr, --momentum, --seed, --log-interval, --num-threads, --fp16-allreduce, ...")
    parser.add_argument("--num-proc", type=int, default=2, metavar="N", help="number of Spark tasks (default: 2)")
    parser.add_argument("--master", default=None,
                        help="Spark master when no session is running yet (default: local[N])")
    parser.add_argument("--start-timeout", type=float, default=120, metavar="S",
                        help="bound on Spark starting all the tasks (default: 120)")
    spark_args, training_argv = parser.parse_known_args(argv)
    training_argv.append("--no-cuda")  # hora.spark.run's tasks get no GPU here
    training = pytorch_mnist.parse_args(training_argv)  # checked before anything starts
    if training.use_adasum:
        parser.error("--use-adasum: hora does not implement Adasum yet; run without it")
    return spark_args, training_argv, training


def main(argv=None) -> float:
    spark_args, training_argv, training = parse_args(argv)
    spark = (SparkSession.builder.master(spark_args.master or f"local[{spark_args.num_proc}]")
             .appName("hora spark_run").getOrCreate())
    started = time.perf_counter()
    accuracies = hora.spark.run(pytorch_mnist.main, args=[training_argv], num_proc=spark_args.num_proc,
                                start_timeout=spark_args.start_timeout)
    print(f"hora.spark.run returned: test accuracy {100.0 * accuracies[0]:.2f}% after {training.epochs} "
          f"epoch(s) on {len(accuracies)} Spark task(s), {time.perf_counter() - started:.1f} s", flush=True)
    del spark
    return accuracies[0]


if __name__ == "__main__":
    main()
