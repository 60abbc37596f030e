#!/usr/bin/env python
"""Gluon data-parallel training throughput on 2 workers, side by side: hora.mxnet's DistributedTrainer
(2 processes under ``hora.run``) against MXNet's own data parallelism, a ``gluon.Trainer`` over a
kvstore ('device' and 'local': one process, two CPU contexts, each taking half the batch), and one
undistributed process.

Run it with the Python that has MXNet 1.9.1 (its own environment, docs/mxnet.md):

    python benchmarks/mxnet_vs_kvstore.py                       # MLP 512x3, batch 64 per worker, 3 rounds
    python benchmarks/mxnet_vs_kvstore.py --rounds 5 --iters 40 --json

Every contender trains the same MLP on the same fixed random batch, with the same batch per worker,
one compute thread per worker (the kvstore process gets two, one per context), and the same timed
steps after the same warm-up, each in a fresh process; contenders take turns round after round and
the median round is reported. Throughput is samples per second over all workers.

MXNet's multi-process kvstore ('dist_sync', ps-lite) needs a scheduler and server processes; started
by hand here on loopback (DMLC_ROLE scheduler/server/worker, DMLC_PS_ROOT_URI=127.0.0.1,
DMLC_INTERFACE=lo) its workers never got past ``mx.kv.create('dist_sync')`` within 40 s, so it is not
a contender; the in-process kvstores are MXNet's data parallelism that runs on one host without extra
infrastructure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKERS = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step (default: 64)")
    p.add_argument("--hidden", type=int, default=512, help="width of the 3 hidden layers (default: 512)")
    p.add_argument("--iters", type=int, default=30, help="timed steps (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all contenders (default: 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # internal: run one contender
    return p.parse_args(argv)


def _net(mx, hidden: int):
    from mxnet import gluon

    net = gluon.nn.HybridSequential()
    for _ in range(3):
        net.add(gluon.nn.Dense(hidden, activation="relu"))
    net.add(gluon.nn.Dense(10))
    return net


def _batch(np_, rows: int):
    rng = np_.random.RandomState(0)
    return rng.rand(rows, 784).astype("float32"), rng.randint(0, 10, rows).astype("float32")


def _train(args, trainer_for, contexts, rows: int) -> float:
    """Seconds for ``args.iters`` steps after ``args.warmup``, one batch of ``rows`` split over ``contexts``."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    net = _net(mx, args.hidden)
    net.initialize(mx.init.Xavier(), ctx=contexts)
    net.hybridize()
    x, y = _batch(np, rows)
    datas = gluon.utils.split_and_load(mx.nd.array(x), contexts)
    labels = gluon.utils.split_and_load(mx.nd.array(y), contexts)
    for d in datas:
        net(d)  # finish deferred initialisation before the trainer sees the parameters
    trainer = trainer_for(net)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    start = 0.0
    for step in range(args.warmup + args.iters):
        if step == args.warmup:
            mx.nd.waitall()
            start = time.perf_counter()
        with autograd.record():
            losses = [loss_fn(net(d), label) for d, label in zip(datas, labels)]
        autograd.backward(losses)
        trainer.step(rows)
    mx.nd.waitall()
    return time.perf_counter() - start


def _hora_worker(args) -> float:
    import mxnet as mx

    import hora.mxnet as hvd

    hvd.init()

    def trainer_for(net):
        hvd.broadcast_parameters(net.collect_params(), root_rank=0)
        return hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9})

    seconds = _train(args, trainer_for, [mx.cpu()], args.batch)
    return hvd.allreduce(mx.nd.array([seconds]), op=hvd.Max, name="seconds").asscalar()


def run_mode(args) -> float:
    """Samples per second of one contender, all workers together."""
    import mxnet as mx
    from mxnet import gluon

    if args.mode == "hora":
        import hora

        env = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}
        seconds = hora.run(_hora_worker, args=(args,), np=WORKERS, env=env)[0]
        return WORKERS * args.batch * args.iters / seconds
    if args.mode in ("device", "local"):
        contexts = [mx.cpu(i) for i in range(WORKERS)]

        def trainer_for(net):
            return gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                 kvstore=args.mode)

        seconds = _train(args, trainer_for, contexts, WORKERS * args.batch)
        return WORKERS * args.batch * args.iters / seconds
    if args.mode == "single":
        def trainer_for(net):
            return gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=None)

        seconds = _train(args, trainer_for, [mx.cpu()], args.batch)
        return args.batch * args.iters / seconds
    raise ValueError(f"unknown mode {args.mode}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode:
        print(json.dumps({"rate": run_mode(args)}), flush=True)
        return
    threads = {"hora": "1", "device": str(WORKERS), "local": str(WORKERS), "single": "1"}
    rates: dict[str, list[float]] = {m: [] for m in threads}
    base = [sys.executable, os.path.abspath(__file__), "--batch", str(args.batch), "--hidden", str(args.hidden),
            "--iters", str(args.iters), "--warmup", str(args.warmup)]
    for _ in range(args.rounds):
        for mode, n in threads.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
            env.update({"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": n})
            proc = subprocess.run([*base, "--mode", mode], env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
            rates[mode].append(json.loads(proc.stdout.strip().splitlines()[-1])["rate"])
    median = {m: statistics.median(v) for m, v in rates.items()}
    result = {"workers": WORKERS, "batch_per_worker": args.batch, "hidden": args.hidden, "iters": args.iters,
              "rounds": args.rounds, "samples_per_sec": median, "all_rounds": rates,
              "hora_over_device": median["hora"] / median["device"],
              "hora_over_local": median["hora"] / median["local"],
              "hora_over_single": median["hora"] / median["single"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"MLP 3x{args.hidden}, batch {args.batch} per worker, {WORKERS} workers, {args.iters} steps, "
          f"median of {args.rounds} rounds (samples/sec, all workers):")
    for mode, label in [("hora", "hora.mxnet DistributedTrainer, 2 processes"),
                        ("device", "gluon.Trainer kvstore='device', 1 process x 2 contexts"),
                        ("local", "gluon.Trainer kvstore='local', 1 process x 2 contexts"),
                        ("single", "one process, no distribution")]:
        print(f"  {label:58s} {median[mode]:10.1f}")
    print(f"  hora/device {result['hora_over_device']:.2f}   hora/local {result['hora_over_local']:.2f}   "
          f"hora/single {result['hora_over_single']:.2f} (ideal {WORKERS})")


if __name__ == "__main__":
    main()
