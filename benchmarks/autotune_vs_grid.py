#!/usr/bin/env python
"""Autotune against a grid search of the same knobs, on one 2-rank workload.

The workload imitates a backward pass: per step, 48 gradients of 4 KiB, 64 KiB and 1 MiB are submitted
one by one with a little compute between them, then the step waits for all. How they are fused (the
fusion threshold) and how often the engine cycles decide its speed.

1. Grid: one job per (fusion threshold, cycle time) point, each timing ``--steps`` steps.
2. Autotune: a job under ``--autotune`` that trains until the tuner is done; its final setting is read
   from the autotune log (last row), and the log is checked to parse.
3. The best grid point and the tuned setting are timed again, taking turns for ``--rounds`` rounds
   (the machine is shared), and the tuned one's throughput is reported as a ratio of the best's.

    python benchmarks/autotune_vs_grid.py            # about a minute or two on 2 cores
    python benchmarks/autotune_vs_grid.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

SIZES = (1024, 16 * 1024, 256 * 1024)  # float32 elements: 4 KiB, 64 KiB, 1 MiB
TENSORS = 48
GRID_FUSION_MB = (0.0, 0.25, 1.0, 4.0, 16.0, 64.0)
GRID_CYCLE_MS = (1.0, 5.0)


def worker(steps: int, until_tuned: bool) -> dict[str, Any] | None:
    """One rank: bytes reduced per second over ``steps`` steps (after the tuner finished, if tuning)."""
    import numpy as np

    import hora
    from hora import basics

    hora.init()
    grads = [np.ones(SIZES[i % len(SIZES)], np.float32) for i in range(TENSORS)]
    work = np.ones((48, 48), np.float32)
    total_bytes = sum(g.nbytes for g in grads)

    def step() -> None:
        handles = []
        for i, g in enumerate(grads):
            work @ work  # a little compute between gradients, as in backward
            handles.append(hora.allreduce_async(g, name=f"grad.{i}"))
        for h in handles:
            hora.synchronize(h)

    tuned_steps = 0
    if until_tuned:
        tuner = basics.engine().autotuner
        while tuner.active and tuned_steps < 5000:
            step()
            tuned_steps += 1
    for _ in range(3):
        step()
    hora.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    slowest = hora.allreduce(np.array([elapsed]), op=hora.Max)[0]
    rank = hora.rank()
    hora.shutdown()
    if rank != 0:
        return None
    return {"mb_per_s": total_bytes * steps / slowest / 1e6, "tuning_steps": tuned_steps}


def _run(steps: int, knobs: dict[str, str], until_tuned: bool = False) -> dict[str, Any]:
    import hora

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(knobs)
    results = hora.run(worker, args=(steps, until_tuned), np=2, env=env)
    return results[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="turns of the final comparison")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="a 2-point grid and a short tuning (checks the benchmark runs; not a result)")
    args = parser.parse_args()

    grid = {}
    fusions, cycles = ((0.0, 16.0), (1.0,)) if args.quick else (GRID_FUSION_MB, GRID_CYCLE_MS)
    for fusion in fusions:
        for cycle in cycles:
            knobs = {"HORA_FUSION_THRESHOLD": str(int(fusion * 1024 * 1024)), "HORA_CYCLE_TIME": str(cycle)}
            grid[(fusion, cycle)] = _run(args.steps, knobs)["mb_per_s"]
    best_point = max(grid, key=grid.get)

    from hora.engine.autotune import read_log

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "autotune.csv")
        tuned_run = _run(args.steps, {"HORA_AUTOTUNE": "1", "HORA_AUTOTUNE_LOG": log,
                                      "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "2" if args.quick else "5",
                                      "HORA_AUTOTUNE_WARMUP_SAMPLES": "1" if args.quick else "2",
                                      "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "4" if args.quick else "16"},
                         until_tuned=True)
        rows = read_log(log)
    final = rows[-1]
    tuned_knobs = {"HORA_FUSION_THRESHOLD": str(int(final["tensor_fusion_threshold"] * 1024 * 1024)),
                   "HORA_CYCLE_TIME": str(final["cycle_time_ms"]),
                   "HORA_CACHE_CAPACITY": "1024" if final["cache_enabled"] else "0"}
    best_knobs = {"HORA_FUSION_THRESHOLD": str(int(best_point[0] * 1024 * 1024)),
                  "HORA_CYCLE_TIME": str(best_point[1])}
    best_times, tuned_times = [], []
    for _ in range(args.rounds):
        best_times.append(_run(args.steps, best_knobs)["mb_per_s"])
        tuned_times.append(_run(args.steps, tuned_knobs)["mb_per_s"])
    report = {
        "grid_mb_per_s": {f"{f:g} MiB / {c:g} ms": round(v, 1) for (f, c), v in grid.items()},
        "best_grid_point": {"fusion_mb": best_point[0], "cycle_ms": best_point[1]},
        "tuned_point": {"fusion_mb": final["tensor_fusion_threshold"], "cycle_ms": final["cycle_time_ms"],
                        "cache_enabled": bool(final["cache_enabled"])},
        "autotune_log_rows": len(rows), "tuning_steps": tuned_run["tuning_steps"],
        "best_grid_mb_per_s": round(max(best_times), 1), "tuned_mb_per_s": round(max(tuned_times), 1),
        "ratio_tuned_to_best": round(max(tuned_times) / max(best_times), 3),
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("grid (MB/s reduced):")
        for point, value in report["grid_mb_per_s"].items():
            print(f"  {point:<20}{value:>10}")
        print(f"best grid point: {report['best_grid_point']}  tuned: {report['tuned_point']} "
              f"(after {report['tuning_steps']} steps, {len(rows)} log rows)")
        print(f"re-timed, best of {args.rounds} turns: best grid {report['best_grid_mb_per_s']} MB/s, "
              f"tuned {report['tuned_mb_per_s']} MB/s, ratio {report['ratio_tuned_to_best']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
