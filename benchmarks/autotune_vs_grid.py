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

Every measurement is a job of its own (fresh processes, the knobs in their environment). With
``--shared-workers`` the grid and the tuning run share one job, and the final comparison another:
each measurement still joins hora anew with its knobs set, but in warm processes, so report
numbers from fresh ones, the default.

    python benchmarks/autotune_vs_grid.py            # about a minute or two on 2 cores
    python benchmarks/autotune_vs_grid.py --json
    python benchmarks/autotune_vs_grid.py --quick --steps 3 --rounds 1 --shared-workers   # does it run?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
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


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}


def _run(steps: int, knobs: dict[str, str], until_tuned: bool = False) -> dict[str, Any]:
    import hora

    env = _base_env()
    env.update(knobs)
    results = hora.run(worker, args=(steps, until_tuned), np=2, env=env)
    return results[0]


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` set inside the block: the knobs ``hora.init()`` reads."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def shared_worker(steps: int, points: list[tuple[dict[str, str], bool]]) -> list[dict[str, Any] | None]:
    """Each ``(knobs, until_tuned)`` measurement in turn in this one process (``--shared-workers``)."""
    results = []
    for knobs, until_tuned in points:
        with _environ(knobs):
            results.append(worker(steps, until_tuned))
    return results


def measure(steps: int, points: list[tuple[dict[str, str], bool]], shared: bool) -> list[dict[str, Any]]:
    """Rank 0's result of each ``(knobs, until_tuned)`` measurement: a job each, or one job for all."""
    if not shared:
        return [_run(steps, knobs, until_tuned) for knobs, until_tuned in points]
    import hora

    return hora.run(shared_worker, args=(steps, points), np=2, env=_base_env())[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="turns of the final comparison")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="a 2-point grid and a short tuning (checks the benchmark runs; not a result)")
    parser.add_argument("--shared-workers", action="store_true",
                        help="one job for the grid and the tuning, one for the comparison, instead of a job "
                             "per measurement: less start-up; warm processes, so not for results")
    args = parser.parse_args()

    fusions, cycles = ((0.0, 16.0), (1.0,)) if args.quick else (GRID_FUSION_MB, GRID_CYCLE_MS)
    points = [(fusion, cycle) for fusion in fusions for cycle in cycles]

    from hora.engine.autotune import read_log

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "autotune.csv")
        tuning = {"HORA_AUTOTUNE": "1", "HORA_AUTOTUNE_LOG": log,
                  "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "2" if args.quick else "5",
                  "HORA_AUTOTUNE_WARMUP_SAMPLES": "1" if args.quick else "2",
                  "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "4" if args.quick else "16"}
        # The grid, one measurement per point, then the tuning run.
        *grid_runs, tuned_run = measure(
            args.steps, [({"HORA_FUSION_THRESHOLD": str(int(fusion * 1024 * 1024)), "HORA_CYCLE_TIME": str(cycle)},
                          False) for fusion, cycle in points] + [(tuning, True)], args.shared_workers)
        rows = read_log(log)
    grid = {point: run["mb_per_s"] for point, run in zip(points, grid_runs)}
    best_point = max(grid, key=grid.get)
    final = rows[-1]
    tuned_knobs = {"HORA_FUSION_THRESHOLD": str(int(final["tensor_fusion_threshold"] * 1024 * 1024)),
                   "HORA_CYCLE_TIME": str(final["cycle_time_ms"]),
                   "HORA_CACHE_CAPACITY": "1024" if final["cache_enabled"] else "0"}
    best_knobs = {"HORA_FUSION_THRESHOLD": str(int(best_point[0] * 1024 * 1024)),
                  "HORA_CYCLE_TIME": str(best_point[1])}
    # Taking turns: best, tuned, best, tuned, ...
    turns = measure(args.steps, [(knobs, False) for _ in range(args.rounds) for knobs in (best_knobs, tuned_knobs)],
                    args.shared_workers)
    best_times = [run["mb_per_s"] for run in turns[0::2]]
    tuned_times = [run["mb_per_s"] for run in turns[1::2]]
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
