#!/usr/bin/env python
"""What tensor fusion buys, and what the engine costs per step: one 2-rank job, three timings.

(a) ``fused``: 64 async allreduces of 4 KiB float32 per step (the engine fuses them);
(a') ``grouped``: the same 64 tensors as one ``grouped_allreduce_async`` (one submission);
(b) ``single``: one 256 KiB float32 allreduce per step through the engine (same bytes as (a));
(c) ``raw``: the same 256 KiB allreduce straight on a communicator of the same job, outside the
    engine: a second world formed by ``connect_world()`` exactly as ``init`` forms the engine's (same
    transport: shared memory for ranks on one host unless ``--transport tcp``), so the engine's own
    keeps cycling idle, as it does around every engine step; each raw step also copies the input in
    to the transport's own buffer (``allocate()``, shared memory) and the result out to a new array,
    as the engine does.

Reported per step, slowest rank wins: ``ratio a/b`` (near 1 means fusing 64 small tensors costs little
more than sending one of their total size) and ``engine overhead = b - c`` in microseconds (the
steady-state cost of submission, the cached negotiation cycle, and handle completion).
The phases take turns for ``--rounds`` rounds and each keeps its best mean, as the machine is shared.

    python benchmarks/engine_fusion.py                 # 300 steps x 3 rounds
    python benchmarks/engine_fusion.py --steps 1000 --json
    python benchmarks/engine_fusion.py --transport tcp   # force the TCP ring for both
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

SMALL_COUNT, SMALL_ELEMENTS = 64, 1024  # 64 x 4 KiB
BIG_ELEMENTS = SMALL_COUNT * SMALL_ELEMENTS  # 256 KiB


def worker(steps: int, warmup: int, rounds: int) -> dict[str, Any] | None:
    """One rank: best mean seconds per step of each phase, the slowest rank's (rank 0 returns it)."""
    import numpy as np

    import hora
    from hora import basics
    from hora.runtime import connect_world
    from hora.transport import ReduceOp

    raw = connect_world()  # formed as init forms the engine's world; every rank calls it once
    hora.init()
    small = [np.full(SMALL_ELEMENTS, i, np.float32) for i in range(SMALL_COUNT)]
    big = np.ones(BIG_ELEMENTS, np.float32)
    # The transport's best path for a tensor the caller keeps: copy in to the transport's own buffer
    # (shared memory reduces there in place), reduce, copy out to a new result, as the engine must.
    raw_buf = raw.allocate(big.nbytes).view(big.dtype) if hasattr(raw, "allocate") else np.empty_like(big)

    def fused() -> None:
        handles = [hora.allreduce_async(t, op=hora.Sum, name=f"fused.{i}") for i, t in enumerate(small)]
        for h in handles:
            hora.synchronize(h)

    def grouped() -> None:
        for h in hora.grouped_allreduce_async(small, op=hora.Sum, name="grouped"):
            hora.synchronize(h)

    def single() -> None:
        hora.allreduce(big, op=hora.Sum, name="single")

    def transport() -> None:
        raw_buf[...] = big
        raw.allreduce(raw_buf, ReduceOp.SUM)
        raw_buf.copy()

    phases = {"fused": fused, "grouped": grouped, "single": single, "raw": transport}
    best = {name: float("inf") for name in phases}
    try:
        for _ in range(rounds):
            for name, step in phases.items():
                for _ in range(warmup):
                    step()
                raw.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                mean = (time.perf_counter() - start) / steps
                slowest = max(raw.allgather_object(mean))
                best[name] = min(best[name], slowest)
        rank = hora.rank()
        transport = f"{type(raw).__name__} (engine: {type(basics._ctx.runtime.world).__name__})"
    finally:
        hora.shutdown()
        raw.close()
    return {"best": best, "transport": transport} if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per phase and round (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before each phase (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; best mean wins (default 3)")
    parser.add_argument("--transport", choices=("auto", "tcp", "shm"), default=None,
                        help="HORA_TRANSPORT for the job (default: hora's default, auto)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")

    import hora

    env = {"HORA_TRANSPORT": args.transport} if args.transport else {}
    outcome = hora.run(worker, args=(args.steps, args.warmup, args.rounds), np=2, env=env)[0]
    best = outcome["best"]
    us = {name: seconds * 1e6 for name, seconds in best.items()}
    report = {
        "world_size": 2,
        "transport": outcome["transport"],
        "steps": args.steps,
        "rounds": args.rounds,
        "fused_64x4KiB_us": round(us["fused"], 1),
        "grouped_64x4KiB_us": round(us["grouped"], 1),
        "single_256KiB_us": round(us["single"], 1),
        "raw_transport_256KiB_us": round(us["raw"], 1),
        "ratio_fused_over_single": round(us["fused"] / us["single"], 3),
        "ratio_grouped_over_single": round(us["grouped"] / us["single"], 3),
        "engine_overhead_us": round(us["single"] - us["raw"], 1),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"2 ranks, {args.steps} steps x {args.rounds} rounds, best mean per step (slowest rank); "
              f"transport {outcome['transport']}")
        print(f"  (a) 64 x 4 KiB async allreduces (fused): {us['fused']:9.1f} us")
        print(f"  (a') the same 64 as one grouped_allreduce: {us['grouped']:7.1f} us")
        print(f"  (b) 1 x 256 KiB allreduce (engine):     {us['single']:9.1f} us")
        print(f"  (c) 1 x 256 KiB allreduce (transport):  {us['raw']:9.1f} us")
        print(f"  ratio a/b:                              {report['ratio_fused_over_single']:9.3f}")
        print(f"  ratio a'/b:                             {report['ratio_grouped_over_single']:9.3f}")
        print(f"  engine overhead per step, b - c:        {report['engine_overhead_us']:9.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
