#!/usr/bin/env python
"""Sharded optimizer state and gradients (ZeRO stages 1 and 2), side by side: memory per rank and speed.

Contenders, each in fresh worker processes, all with Adam:

- ``hora``: ``hvd.DistributedOptimizer``, every rank holding the whole state;
- ``hora-stage1``: ``hvd.DistributedOptimizer(..., shard_optimizer_state=True)``;
- ``hora-stage2``: ``hvd.DistributedOptimizer(..., shard_gradients=True)``;
- ``hora-zero``: ``hvd.ZeroRedundancyOptimizer`` (torch's API on hora);
- ``ddp``: PyTorch DDP (Gloo) with a plain Adam;
- ``torch-zero``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer``.

**Memory** (``--part memory``): a wide MLP whose Adam state is 201 MB takes a few steps at each world
size given. Each rank reports the optimizer state it holds, counted tensor by tensor
(``hora.torch.memory_report``; the local optimizer's for torch's class), and what the operating
system saw: how far the process's resident set grew from just before the first step (parameters
built, optimizer wrapped, no gradient or state yet), at its peak (``ru_maxrss``) and after the last
step. The bars (issue 33): sharded, a rank holds at most 1/N + 5% of the unsharded state, and with
stage 2 at most 1/N + 5% of the unsharded gradients too.

**Speed** (``--part speed``): images per second of ResNet-18 (64x64 images, batch 16 per worker) and
of the 200-tensor MLP (batch 32) from examples/pytorch_synthetic_benchmark.py, the slowest rank's
time over the timed steps, median of ``--rounds`` rounds taken in turns. The bars: stages 1 and 2 at
least 0.95x unsharded hora, and at least 1.0x torch's ZeroRedundancyOptimizer with DDP.

    python benchmarks/zero_memory.py                         # both parts: memory at 2 and 4 ranks, speed at 2
    python benchmarks/zero_memory.py --part memory --np 2,3,4
    python benchmarks/zero_memory.py --part speed --rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from rank_sync import gloo_sync, hora_sync
from synthetic_models import SHAPES, comma_list, model_and_batch

CONTENDERS = ("hora", "hora-stage1", "hora-stage2", "hora-zero", "ddp", "torch-zero")
SHARDED = ("hora-stage1", "hora-stage2", "hora-zero", "torch-zero")
GRADIENTS_SHARDED = ("hora-stage2",)
#: The memory part's model: this many Linear(WIDTH, WIDTH) layers and a 10-class head.
WIDE_LAYERS, WIDTH = 24, 1024
SPEED_MODELS = tuple(SHAPES)
MB = 1e6


@dataclass(frozen=True)
class Config:
    contender: str
    model: str  # "wide" (memory) or one of SPEED_MODELS
    steps: int  # memory: steps taken; speed: timed steps
    warmup: int = 0
    lr: float = 1e-4
    seed: int = 42


def _wide_model() -> Any:
    import torch.nn as nn

    layers: list[nn.Module] = []
    for _ in range(WIDE_LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def _build(cfg: Config) -> tuple[Any, Any, Any]:
    """The model and one synthetic batch, the same on every rank and for every contender."""
    import torch

    if cfg.model != "wide":
        return model_and_batch(cfg.model, cfg.seed)
    torch.manual_seed(cfg.seed)
    return _wide_model(), torch.randn(8, WIDTH), torch.randint(0, 10, (8,))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(cfg: Config) -> dict[str, float]:
    """Build, wrap and train one contender on this rank; returns this rank's figures."""
    import torch
    import torch.nn.functional as F

    from hora import config

    torch.set_num_threads(1)
    model, data, target = _build(cfg)
    if cfg.contender in ("ddp", "torch-zero"):
        from datetime import timedelta

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=config.get("rank"), world_size=config.get("size"),
                                timeout=timedelta(seconds=300))
        trained = DistributedDataParallel(model)  # broadcasts rank 0's parameters
        if cfg.contender == "torch-zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer: Any = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=cfg.lr)
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        sync = gloo_sync()
    else:
        import hora.torch as hvd

        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if cfg.contender == "hora-zero":
            optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=cfg.lr)
        else:
            optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=cfg.lr),
                                                 named_parameters=model.named_parameters(),
                                                 shard_optimizer_state=cfg.contender == "hora-stage1",
                                                 shard_gradients=cfg.contender == "hora-stage2")
        trained = model
        sync = hora_sync()

    def step() -> float:
        optimizer.zero_grad()
        loss = F.cross_entropy(trained(data), target)
        loss.backward()
        optimizer.step()
        return float(loss.item())

    result: dict[str, float] = {}
    if cfg.model == "wide":
        from hora.torch import memory_report

        before = _rss_bytes()
        for _ in range(cfg.steps):
            step()
        held = _rss_bytes() - before
        report = memory_report(getattr(optimizer, "optim", optimizer))  # torch's class: its local optimizer
        whole = memory_report(optimizer)
        result = {"state_bytes": report.optimizer_state, "parameter_bytes": whole.parameters,
                  "gradient_bytes": whole.gradients, "peak_rss_growth": _peak_rss_bytes() - before,
                  "held_rss_growth": held}
    else:
        for _ in range(cfg.warmup):
            step()
        sync.barrier()
        start = time.perf_counter()
        for _ in range(cfg.steps):
            loss = step()
        result = {"seconds": sync.slowest(time.perf_counter() - start), "loss": loss}
    sync.done()
    return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(cfg: Config, np_: int, mmap_threshold: int | None = None) -> list[dict[str, float]]:
    """One run of one contender in ``np_`` fresh workers: every rank's result."""
    import hora

    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    if cfg.contender in ("ddp", "torch-zero"):
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "GLOO_SOCKET_IFNAME": "lo"})
    return hora.run(worker, args=(cfg,), np=np_, env=env)


def memory_rows(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The largest rank's figures: the rank that decides whether a model fits."""
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


def measure_memory(worlds: list[int], steps: int, chosen: list[str],
                   mmap_threshold: int | None = None) -> dict[str, dict[str, dict[str, float]]]:
    table: dict[str, dict[str, dict[str, float]]] = {}
    for np_ in worlds:
        rows = table[str(np_)] = {}
        for contender in chosen:
            rows[contender] = memory_rows(run(Config(contender, "wide", steps), np_, mmap_threshold))
        whole = rows.get("hora", rows.get("ddp"))
        for contender, row in rows.items():
            if whole is not None and whole["state_bytes"]:
                row["state_fraction"] = row["state_bytes"] / whole["state_bytes"]
                row["gradient_fraction"] = row["gradient_bytes"] / whole["gradient_bytes"]
                within = contender not in SHARDED or row["state_fraction"] <= 1 / np_ + 0.05
                if contender in GRADIENTS_SHARDED:
                    within = within and row["gradient_fraction"] <= 1 / np_ + 0.05
                row["within_bar"] = float(within)
    return table


def measure_speed(models: list[str], np_: int, rounds: int, steps: int, warmup: int,
                  chosen: list[str]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for model in models:
        batch = SHAPES[model][0]
        seen: dict[str, list[float]] = {c: [] for c in chosen}
        for _ in range(rounds):
            for contender in chosen:  # in turns: the machine's noise falls on every contender alike
                result = run(Config(contender, model, steps, warmup), np_)[0]
                seen[contender].append(batch * np_ * steps / result["seconds"])
        rows = table[model] = {c: {"img_sec": statistics.median(v), "rounds": v} for c, v in seen.items()}
        for a, b in (("hora-stage1", "hora"), ("hora-stage1", "torch-zero"), ("hora-stage2", "hora"),
                     ("hora-stage2", "torch-zero"), ("hora-zero", "hora"),
                     ("hora-zero", "torch-zero"), ("torch-zero", "ddp"), ("hora", "ddp")):
            if a in rows and b in rows:
                rows.setdefault("ratios", {})[f"{a}/{b}"] = rows[a]["img_sec"] / rows[b]["img_sec"]
    return table


def _wide_sizes() -> tuple[int, int]:
    parameters = WIDE_LAYERS * (WIDTH * WIDTH + WIDTH) + WIDTH * 10 + 10
    return parameters, 2 * 4 * parameters  # Adam: two float32 moments per parameter


def format_memory(table: dict[str, dict[str, dict[str, float]]], steps: int) -> list[str]:
    parameters, state = _wide_sizes()
    lines = [f"memory: wide MLP ({WIDE_LAYERS} x Linear({WIDTH}, {WIDTH}) + head), {parameters / 1e6:.1f} M "
             f"parameters ({4 * parameters / MB:.1f} MB), Adam state {state / MB:.1f} MB unsharded; {steps} steps; "
             f"the largest rank's figures, MB",
             f"{'np':>3} {'contender':<12} {'state':>8} {'of whole':>9} {'bar 1/N+5%':>11} {'grads':>8} "
             f"{'of whole':>9} {'peak RSS +':>11} {'held RSS +':>11}"]
    for np_, rows in table.items():
        for contender, row in rows.items():
            bar = "" if contender not in SHARDED else ("yes" if row.get("within_bar") else "NO")
            fraction = f"{row['state_fraction']:.3f}" if "state_fraction" in row else ""
            gradients = f"{row['gradient_fraction']:.3f}" if "gradient_fraction" in row else ""
            lines.append(f"{np_:>3} {contender:<12} {row['state_bytes'] / MB:>8.1f} {fraction:>9} {bar:>11} "
                         f"{row['gradient_bytes'] / MB:>8.1f} {gradients:>9} {row['peak_rss_growth'] / MB:>11.1f} "
                         f"{row['held_rss_growth'] / MB:>11.1f}")
    return lines


def format_speed(table: dict[str, dict[str, Any]], np_: int, rounds: int) -> list[str]:
    lines = [f"speed: Adam, {np_} workers, images/s of all workers, median of {rounds} round(s)"]
    for model, rows in table.items():
        contenders = [c for c in rows if c != "ratios"]
        lines.append(f"{model}: " + ", ".join(f"{c} {rows[c]['img_sec']:.1f}" for c in contenders))
        lines.append("  " + ", ".join(f"{k} {v:.3f}" for k, v in rows.get("ratios", {}).items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--part", choices=("memory", "speed", "both"), default="both")
    parser.add_argument("--np", default="2,4", help="world sizes of the memory part (default 2,4)")
    parser.add_argument("--speed-np", type=int, default=2, help="workers of the speed part (default 2)")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                        help="set glibc's MALLOC_MMAP_THRESHOLD_ in the memory part's workers: blocks this "
                             "large are mapped and unmapped on their own, so RSS follows what a process "
                             "holds (by default glibc raises the threshold as large blocks are freed and "
                             "keeps later ones in its heap, which RSS still counts after they are freed)")
    parser.add_argument("--models", default=",".join(SPEED_MODELS), help=f"speed models, of {SPEED_MODELS}")
    parser.add_argument("--rounds", type=int, default=3, help="speed rounds per contender (median reported)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per speed run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--only", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    chosen = comma_list(parser, args.only, CONTENDERS, "contenders")
    models = comma_list(parser, args.models, SPEED_MODELS, "models")
    report: dict[str, Any] = {"contenders": chosen}
    if args.part in ("memory", "both"):
        worlds = [int(n) for n in args.np.split(",") if n]
        report["memory"] = measure_memory(worlds, args.memory_steps, chosen, args.malloc_mmap_threshold)
        report["malloc_mmap_threshold"] = args.malloc_mmap_threshold
    if args.part in ("speed", "both"):
        report["speed"] = measure_speed(models, args.speed_np, args.rounds, args.steps, args.warmup, chosen)
        report["speed_config"] = asdict(Config("", "", args.steps, args.warmup)) | {"np": args.speed_np,
                                                                                   "rounds": args.rounds}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    lines: list[str] = []
    if "memory" in report:
        lines += format_memory(report["memory"], args.memory_steps)
        if args.malloc_mmap_threshold is not None:
            lines.append(f"(workers ran with MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold})")
    if "speed" in report:
        lines += format_speed(report["speed"], args.speed_np, args.rounds)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
