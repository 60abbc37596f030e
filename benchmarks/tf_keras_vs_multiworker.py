"""Keras 2 (tf_keras) data-parallel training speed on 2 ranks: hora vs MultiWorkerMirroredStrategy,
against one process, side by side in one run.

Every run trains the same MLP on synthetic data with ``model.fit`` under ``TF_USE_LEGACY_KERAS=1``,
one compute thread per process, the same per-process batch, and reports samples per second over
the timed steps (after warm-up steps that compile the step):

- ``single``: one process, no distribution;
- ``hora``: ``hora run -np 2``, ``hvd.DistributedOptimizer`` (the reduction inside the compiled step);
- ``mwms``: 2 processes with ``TF_CONFIG`` on loopback and ``tf.distribute.MultiWorkerMirroredStrategy``
  (TensorFlow's own multi-worker data-parallel tool; its collectives go over gRPC).

    python benchmarks/tf_keras_vs_multiworker.py [--steps 200] [--batch 64] [--repeats 3]

Prints one line per run and the medians; on a 2-core box the 2-rank runs share the cores, so the
useful figures are the ratios hora/mwms and 2-rank vs single.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def worker(mode: str, steps: int, warmup: int, batch: int) -> None:
    """One process's training; rank 0 prints `RESULT <samples/s over all processes>`."""
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank, size, strategy = 0, 1, None
    if mode == "hora":
        import hora.keras as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif mode == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank, size = json.loads(os.environ["TF_CONFIG"])["task"]["index"], strategy.num_replicas_in_sync

    def build():
        model = keras.Sequential([keras.layers.Dense(512, activation="relu", input_shape=(256,)),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        if mode == "hora":
            opt = hvd.DistributedOptimizer(opt)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    if strategy is not None:
        with strategy.scope():
            model = build()
    else:
        model = build()
    rng = np.random.default_rng(rank)
    global_batch = batch * size if mode == "mwms" else batch  # MWMS splits the global batch
    rows = global_batch * (steps + warmup)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    y = rng.integers(0, 10, rows)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat()
    if strategy is not None:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        data = data.with_options(options)
    model.fit(data, steps_per_epoch=warmup, epochs=1, verbose=0)
    started = time.perf_counter()
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    seconds = time.perf_counter() - started
    if rank == 0:
        print(f"RESULT {batch * size * steps / seconds:.1f}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(out: str) -> float:
    for line in out.splitlines():
        if "RESULT " in line:
            return float(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"no RESULT line in:\n{out[-3000:]}")


def run(mode: str, args: argparse.Namespace) -> float:
    me = [os.path.abspath(__file__), "--worker", mode, "--steps", str(args.steps), "--warmup", str(args.warmup),
          "--batch", str(args.batch)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(ENV)
    if mode == "single":
        return _result(subprocess.run([sys.executable, *me], env=env, capture_output=True, text=True,
                                      timeout=600, check=True).stdout)
    if mode == "hora":
        return _result(subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, *me],
                                      env=env, capture_output=True, text=True, timeout=600, check=True).stdout)
    ports = [_free_port(), _free_port()]
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = [subprocess.Popen([sys.executable, *me], env={**env, "TF_CONFIG": json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": i}})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"MultiWorkerMirroredStrategy run failed:\n{outs[0][-2000:]}\n{outs[1][-2000:]}")
    return _result(outs[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["single", "hora", "mwms"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=200, help="timed steps (default: 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default: 20)")
    parser.add_argument("--batch", type=int, default=64, help="batch per process (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved (default: 3)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.batch)
        return
    results: dict[str, list[float]] = {"single": [], "hora": [], "mwms": []}
    for i in range(args.repeats):
        for mode in results:
            value = run(mode, args)
            results[mode].append(value)
            print(f"run {i + 1} {mode:6s}: {value:9.1f} samples/s", flush=True)
    median = {mode: statistics.median(values) for mode, values in results.items()}
    print(f"median samples/s: single {median['single']:.1f}, hora 2 ranks {median['hora']:.1f}, "
          f"MultiWorkerMirroredStrategy 2 ranks {median['mwms']:.1f}")
    print(f"hora / MultiWorkerMirroredStrategy: {median['hora'] / median['mwms']:.2f}; "
          f"hora 2 ranks / single: {median['hora'] / median['single']:.2f}")


if __name__ == "__main__":
    main()
