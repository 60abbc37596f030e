#!/usr/bin/env python
"""Data-parallel JAX training on CPU, side by side: hora.jax's DistributedOptimizer on 2 processes
against JAX's own data parallelism (``jax.pmap`` with ``lax.pmean``) over 2 CPU devices of one process
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``).

Both train the same MLP (examples/jax_synthetic_benchmark.py's model) on fixed random batches of the
same size per worker/device, with SGD, the same warm-up and the same number of timed steps, and XLA held
to one compute thread per worker/device. hora's workers are fresh processes started by ``hora run``;
their gradients cross processes through one host callback per step. The machine is shared and noisy,
so the contenders take turns, round after round, and the median round is reported.

    python benchmarks/jax_vs_pmap.py                       # MLP 3x512 on 32x32x3 inputs, batch 32
    python benchmarks/jax_vs_pmap.py --hidden 1024 --rounds 5 --json

Throughput is images per second over both workers; ``hora/pmap`` above 1 means hora is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="batch per worker / device")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--role", choices=["hora", "pmap"], default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _setup(args):
    import jax
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from jax_synthetic_benchmark import loss_fn, make_model

    inputs = 3 * args.image_size * args.image_size
    params = make_model(jax.random.PRNGKey(0), inputs, args.hidden, args.layers)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, args.batch_size, inputs)).astype(np.float32)
    y = rng.integers(0, 1000, size=(2, args.batch_size)).astype(np.int32)
    return params, x, y, loss_fn


def _time(step, state, args) -> float:
    import jax

    for _ in range(args.warmup):
        state = step(*state)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(args.steps):
        state = step(*state)
    jax.block_until_ready(state)
    return time.perf_counter() - start


def run_hora(args) -> None:
    import jax
    import optax

    import hora.jax as hvd

    hvd.init()
    params, x, y, loss_fn = _setup(args)
    tx = hvd.DistributedOptimizer(optax.sgd(0.01))
    xs, ys = jax.numpy.asarray(x[hvd.rank()]), jax.numpy.asarray(y[hvd.rank()])

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss_fn)(params, xs, ys), state, params)
        return optax.apply_updates(params, updates), state

    seconds = _time(step, (params, tx.init(params)), args)
    slowest = max(hvd.allgather_object(seconds))
    if hvd.rank() == 0:
        print("RESULT", json.dumps({"seconds": slowest}), flush=True)


def run_pmap(args) -> None:
    import jax
    import optax

    assert jax.local_device_count() == 2, jax.devices()
    params, x, y, loss_fn = _setup(args)
    tx = optax.sgd(0.01)

    def step(params, state, xs, ys):
        grads = jax.lax.pmean(jax.grad(loss_fn)(params, xs, ys), "workers")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    pstep = jax.pmap(step, axis_name="workers")

    # pmap splits the leading axis over the devices: stack a copy per device (the params) or the
    # per-device batches.
    def replicate(tree):
        return jax.tree_util.tree_map(lambda a: jax.numpy.stack([a, a]), tree)

    xs, ys = jax.numpy.asarray(x), jax.numpy.asarray(y)
    seconds = _time(lambda p, s: pstep(p, s, xs, ys), (replicate(params), replicate(tx.init(params))), args)
    print("RESULT", json.dumps({"seconds": seconds}), flush=True)


def _launch(role: str, args, argv: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update({"OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"})
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, *argv]
    if role == "hora":
        env["XLA_FLAGS"] = ONE_THREAD
        cmd = [sys.executable, "-m", "hora", "run", "-np", "2", *cmd]
    else:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {ONE_THREAD}"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])["seconds"]
    raise RuntimeError(f"{role} run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.role == "hora":
        return run_hora(args)
    if args.role == "pmap":
        return run_pmap(args)
    passed = [a for a in argv if a != "--json"]
    images = 2 * args.batch_size * args.steps
    rounds = {"hora": [], "pmap": []}
    for _ in range(args.rounds):
        for role in ("hora", "pmap"):
            rounds[role].append(images / _launch(role, args, passed))
    result = {role: statistics.median(rates) for role, rates in rounds.items()}
    result["hora/pmap"] = result["hora"] / result["pmap"]
    result["rounds"] = rounds
    result["model"] = (f"MLP {args.layers}x{args.hidden}, input {3 * args.image_size ** 2}, "
                       f"batch {args.batch_size}/worker")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['model']}, {args.steps} steps, median of {args.rounds} rounds (images/sec, 2 workers):")
        print(f"  hora.jax DistributedOptimizer, 2 processes: {result['hora']:.1f}")
        print(f"  jax.pmap + lax.pmean, 2 CPU devices:        {result['pmap']:.1f}")
        print(f"  hora/pmap: {result['hora/pmap']:.2f}")
    return result


if __name__ == "__main__":
    main()
