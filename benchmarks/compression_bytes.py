#!/usr/bin/env python
"""Bytes on the wire per training step with gradient compression, counted by hora's transports.

Every contender trains the same model from the same seed on the same synthetic batch in fresh
workers over the TCP transport, and reports what ``hora.bytes_sent()`` (the transports' own
counters: every byte handed to a socket, negotiation included) grew by over the timed steps, per
step and per rank, beside the uncompressed run's. The compressed reducers' own accounting of what
they handed to their collectives (``sent_fraction``) is printed next to it, so the counted and the
planned figures can be compared. The issue's bar: ``powersgd(rank=4)`` sends at most 1/20 of the
uncompressed bytes per step on ResNet-18.

On one host the shared-memory transport moves no network bytes, so the workers run with
``HORA_TRANSPORT=tcp``: the same ring algorithms a multi-host job uses between hosts, on loopback.
PowerSGD's first ``--start-iter`` steps are plain allreduces (the warm-up of the PowerSGD paper and of
DDP's hook); the warm-up steps here are at least that many, so the timed ones are all compressed.

    python benchmarks/compression_bytes.py                          # ResNet-18 and the 200-tensor MLP, 2 workers
    python benchmarks/compression_bytes.py --models resnet18 --np 4 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from synthetic_models import SHAPES, comma_list, model_and_batch

CONTENDERS = ("none", "fp16", "powersgd", "topk")
MODELS = tuple(SHAPES)


@dataclass(frozen=True)
class Config:
    contender: str
    model: str
    steps: int
    warmup: int
    rank: int = 4
    ratio: float = 0.01
    start_iter: int = 2
    seed: int = 42


def worker(cfg: Config) -> dict[str, float]:
    """Train one contender on this rank; returns its bytes per step and the reducer's accounting."""
    import torch
    import torch.nn.functional as F

    import hora
    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model, data, target = model_and_batch(cfg.model, cfg.seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                   "powersgd": hvd.Compression.powersgd(rank=cfg.rank, start_iter=cfg.start_iter),
                   "topk": hvd.Compression.topk(ratio=cfg.ratio)}[cfg.contender]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters(), compression=compression)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    for _ in range(max(cfg.warmup, cfg.start_iter if cfg.contender == "powersgd" else 0)):
        step()
    before = hora.bytes_sent()
    if before is None:
        raise RuntimeError("this transport does not count its bytes; run with HORA_TRANSPORT=tcp")
    started = time.perf_counter()
    for _ in range(cfg.steps):
        step()
    seconds = time.perf_counter() - started
    sent = hora.bytes_sent()
    assert sent is not None
    result = {"bytes_per_step": (sent - before) / cfg.steps, "seconds_per_step": seconds / cfg.steps,
              "gradient_bytes": float(sum(p.numel() * p.element_size() for p in model.parameters()))}
    last = getattr(getattr(optimizer, "_step_reducer", None), "last_sent", None)
    if last is not None:
        result["reducer_fraction"] = last.sent_bytes / last.uncompressed_bytes
    hvd.shutdown()
    return result


def run(cfg: Config, np_: int) -> list[dict[str, float]]:
    import hora

    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HORA_TRANSPORT": "tcp"}
    return hora.run(worker, args=(cfg,), np=np_, env=env)


def measure(models: list[str], chosen: list[str], np_: int, steps: int, warmup: int, rank: int, ratio: float,
            start_iter: int) -> dict[str, dict[str, dict[str, float]]]:
    table: dict[str, dict[str, dict[str, float]]] = {}
    for model in models:
        rows = table[model] = {}
        for contender in chosen:
            per_rank = run(Config(contender, model, steps, warmup, rank, ratio, start_iter), np_)
            row = {key: sum(r[key] for r in per_rank) / len(per_rank) for key in per_rank[0]}
            row["max_bytes_per_step"] = max(r["bytes_per_step"] for r in per_rank)
            rows[contender] = row
        if "none" in rows:
            for row in rows.values():
                row["fraction_of_none"] = row["bytes_per_step"] / rows["none"]["bytes_per_step"]
    return table


def format_table(table: dict[str, dict[str, dict[str, float]]], np_: int, rank: int, ratio: float) -> list[str]:
    lines = [f"bytes sent per step and rank (hora.bytes_sent(), TCP transport, {np_} workers; "
             f"powersgd rank {rank}, topk ratio {ratio})",
             f"{'model':<9} {'compression':<11} {'MB/step':>9} {'of none':>9} {'1/x':>7} {'reducer says':>13} "
             f"{'ms/step':>8}"]
    for model, rows in table.items():
        for contender, row in rows.items():
            fraction = row.get("fraction_of_none")
            inverse = f"{1 / fraction:.1f}" if fraction else ""
            planned = f"{row['reducer_fraction']:.4f}" if "reducer_fraction" in row else ""
            lines.append(f"{model:<9} {contender:<11} {row['bytes_per_step'] / 1e6:>9.3f} "
                         f"{fraction if fraction is not None else float('nan'):>9.4f} {inverse:>7} {planned:>13} "
                         f"{row['seconds_per_step'] * 1e3:>8.1f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="workers (default 2)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    parser.add_argument("--only", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    parser.add_argument("--steps", type=int, default=5, help="counted steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="uncounted steps before them")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k's ratio")
    parser.add_argument("--start-iter", type=int, default=2, help="PowerSGD's uncompressed first steps")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    chosen = comma_list(parser, args.only, CONTENDERS, "contenders")
    models = comma_list(parser, args.models, MODELS, "models")
    table = measure(models, chosen, args.np, args.steps, args.warmup, args.rank, args.ratio, args.start_iter)
    if args.json:
        print(json.dumps({"np": args.np, "rank": args.rank, "ratio": args.ratio, "results": table}, indent=2))
    else:
        print("\n".join(format_table(table, args.np, args.rank, args.ratio)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
