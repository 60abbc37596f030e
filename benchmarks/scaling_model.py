#!/usr/bin/env python
"""A small cost model of hora's allreduce and training step, and what it predicts at scale.

    python benchmarks/scaling_model.py                         # predictions with the constants below
    python benchmarks/scaling_model.py --fit rows.json         # refit from scaling_one_host.py --json

The model (every term is one the transport or engine really pays; see docs/scaling.md):
- a message costs ``alpha`` seconds plus its bytes over the link bandwidth ``B``;
- small allreduce (<= 64 KiB): one round of direct sends among <= 8 ranks, else log2(n) rounds of
  recursive doubling: ``rounds * (alpha + S / B)``;
- large allreduce, flat ring over n ranks: ``2 (n - 1) / n * S / B + 2 (n - 1) * alpha``;
- hierarchical over h hosts of g ranks: the same ring over h hosts on the host's link (the g lanes
  share it), plus a reduce-scatter and an allgather inside the host at memory speed ``B_host``;
- a training step: compute time ``C``, of which the backward pass (fraction ``backward``) can hide
  communication that starts as gradients become ready; the last bucket (``1 / buckets`` of the
  gradient) cannot hide; plus ``cycles * per_cycle + tensors * per_tensor`` of engine work;
- the emulated cluster (all hosts on one machine's cores): ``max(link bound + tail, CPU work /
  cores)``, with the CPU seconds per byte measured by cluster_allreduce.py (``--cluster``).
Scaling efficiency is the one-worker step time over the n-worker step time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, replace

DIRECT_MAX = 8
SMALL_BYTES = 64 * 1024


@dataclass(frozen=True)
class Network:
    bandwidth: float  # bytes/s per host link
    alpha: float  # seconds per message (latency plus per-message software cost)
    host_bandwidth: float = 20e9  # bytes/s for copies and reductions inside a host
    # Bytes/s a rank reduces for the ring (each rank touches about S bytes); the emulated cluster,
    # whose hosts share one machine's cores, has its own model (EmulatedCluster below).
    cpu_rate: float = float("inf")


@dataclass(frozen=True)
class Engine:
    per_cycle: float  # seconds of negotiation per engine cycle (measured: the cached cycle time)
    per_tensor: float  # seconds of bookkeeping per tensor per step


def allreduce_seconds(size: float, ranks: int, net: Network, hosts: int = 0) -> float:
    """Predicted time of one allreduce of ``size`` bytes over ``ranks`` ranks (``hosts`` > 1:
    hierarchical over that many hosts of ranks/hosts ranks each)."""
    if ranks <= 1:
        return 0.0
    if size <= SMALL_BYTES:
        rounds = 1 if ranks <= DIRECT_MAX else math.ceil(math.log2(ranks)) + (0 if ranks & (ranks - 1) == 0 else 2)
        return rounds * (net.alpha + size / net.bandwidth * (ranks - 1 if ranks <= DIRECT_MAX else 1))
    if hosts > 1:
        local = ranks // hosts
        inside = 2 * (local - 1) / local * size / net.host_bandwidth if local > 1 else 0.0
        cross = 2 * (hosts - 1) / hosts * size / net.bandwidth + 2 * (hosts - 1) * net.alpha
        return inside + cross
    return 2 * (ranks - 1) / ranks * size / net.bandwidth + 2 * (ranks - 1) * net.alpha + size / net.cpu_rate


@dataclass(frozen=True)
class EmulatedCluster:
    """One rank per emulated host, every host on the same ``cores`` (cluster_allreduce.py)."""

    link: float  # bytes/s each host's link is shaped to
    tail: float  # seconds beyond the link bound when the CPU keeps up: the pipeline's fill and drain
    cpu_per_byte: float  # CPU seconds per byte a rank sends (kernel copies, packet path, reduction)
    cores: int


def emulated_allreduce_seconds(size: float, hosts: int, cluster: EmulatedCluster) -> float:
    """The link bound plus the tail, unless all ranks' CPU work needs longer on the shared cores:
    each of the ``hosts`` ranks sends (and receives, and reduces) ``2 (h - 1) / h * S`` bytes."""
    moved = 2 * (hosts - 1) / hosts * size
    network = moved / cluster.link + cluster.tail
    cpu = hosts * moved * cluster.cpu_per_byte / cluster.cores
    return max(network, cpu)


def run_cpu_seconds(run: dict) -> float:
    """CPU seconds an emulated-cluster run burnt: all ranks' user and system time plus the kernel's
    softirq packet processing (machine-wide, so it includes whatever else ran then)."""
    ranks = run["ranks_cpu"]
    return ranks["user_s"] + ranks["system_s"] + (run.get("machine_cpu_s") or {}).get("softirq", 0.0)


def load_cluster_runs(paths: list[str]) -> list[dict]:
    """Rows of ``cluster_allreduce.py --json`` (one or more per file, JSON lines); of repeated runs
    on the same hosts and ranks the fastest is kept (the machine is shared: best of several)."""
    best: dict[tuple[int, int], dict] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line) if line.strip().startswith("{") else {}
                if "best_s" in row and row.get("ranks_cpu"):
                    key = (row["hosts"], row["ranks"])
                    if key not in best or row["best_s"] < best[key]["best_s"]:
                        best[key] = row
    return list(best.values())


def fit_cluster(runs: list[dict], cores: int) -> EmulatedCluster:
    """Both constants from the smallest run (``cluster_allreduce.py --json``): the tail is its time
    beyond the link bound, the CPU cost per byte is its measured CPU seconds over the bytes sent."""
    first = min(runs, key=lambda r: r["hosts"])
    link = first["link_gbit"] * 1e9 / 8
    hosts = first["hosts"]
    moved = 2 * (hosts - 1) / hosts * first["size_bytes"]
    return EmulatedCluster(link=link, tail=max(0.0, first["best_s"] - moved / link),
                           cpu_per_byte=run_cpu_seconds(first) / (first["ranks"] * moved), cores=cores)


@dataclass(frozen=True)
class Model:
    name: str
    gradient_bytes: float
    tensors: int
    compute_s: float  # one step's forward and backward on one worker
    backward: float = 2 / 3
    buckets: int = 4  # fused allreduces per step (64 MiB fusion buffer over the gradient)


def step_seconds(model: Model, workers: int, per_host: int, net: Network, engine: Engine) -> float:
    hosts = max(1, workers // per_host)
    bucket = model.gradient_bytes / model.buckets
    comm = model.buckets * allreduce_seconds(bucket, workers, net, hosts if per_host > 1 else 0)
    hidden = model.backward * model.compute_s
    exposed = max(comm / model.buckets, comm - hidden)  # the last bucket always waits
    engine_cost = model.buckets * engine.per_cycle + model.tensors * engine.per_tensor
    return model.compute_s + (exposed if workers > 1 else 0.0) + engine_cost


def efficiency(model: Model, workers: int, per_host: int, net: Network, engine: Engine) -> float:
    single = step_seconds(model, 1, per_host, net, engine)
    return single / step_seconds(model, workers, per_host, net, engine)


# Published model sizes; per-step compute of one V100-class GPU at the batch sizes Horovod's
# benchmarks used (assumptions, stated in docs/scaling.md).
RESNET50 = Model("ResNet-50", gradient_bytes=25.6e6 * 4, tensors=161, compute_s=0.25)
BERT_LARGE = Model("BERT-large", gradient_bytes=336e6 * 2, tensors=398, compute_s=0.60)  # fp16 gradients

# Fitted on the development machine (docs/scaling.md): loopback/Unix-socket latency and the engine's
# cached cycle; per-tensor cost from benchmarks/engine_fusion.py.
FITTED_ENGINE = Engine(per_cycle=150e-6, per_tensor=5e-6)
# 90% of line rate for TCP/RDMA payload; a 10 us per-message cost; GPUs reduce far faster than links.
DATACENTRE_100G = Network(bandwidth=100e9 / 8 * 0.9, alpha=10e-6, cpu_rate=200e9)


def fit(rows: list[dict]) -> tuple[Network, Engine]:
    """Constants from ``scaling_one_host.py --json`` rows: alpha from the 2-rank 4-byte allreduce,
    the on-host bandwidth from the 2-rank 1 MiB allreduce, the per-cycle cost from the cached cycle
    minus its allreduce."""
    two = min(rows, key=lambda r: r["ranks"])
    alpha = two["allreduce_4B_us"] * 1e-6 / 2
    mib = 1 << 20
    bandwidth = mib / max(1e-9, two["allreduce_1MiB_us"] * 1e-6 - 2 * alpha)
    per_cycle = max(1e-6, (two["cached_cycle_us"] - two["allreduce_4B_us"]) * 1e-6)
    return Network(bandwidth, alpha, bandwidth), replace(FITTED_ENGINE, per_cycle=per_cycle)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit", help="scaling_one_host.py --json output to fit alpha, B and per_cycle from")
    parser.add_argument("--cluster", help="comma-separated cluster_allreduce.py --json outputs (one rank per "
                        "host) to fit the emulated cluster on its smallest run and predict the others")
    parser.add_argument("--per-host", type=int, default=8, help="GPUs per host (default 8)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="cores the fitted rows ran on: n ranks on c cores share them, so one-host "
                             "times scale by max(1, n / c) (oversubscription, not the network)")
    args = parser.parse_args()
    engine = FITTED_ENGINE
    if args.fit:
        with open(args.fit) as f:
            net, engine = fit(json.load(f))
        print(f"fitted: alpha {net.alpha * 1e6:.1f} us, on-host {net.bandwidth / 1e9:.2f} GB/s, "
              f"per cycle {engine.per_cycle * 1e6:.0f} us")
        for row in json.load(open(args.fit)):
            n = row["ranks"]
            share = max(1.0, n / args.cores)
            print(f"  {n:>3} ranks: 4 B measured {row['allreduce_4B_us']:.0f} us, "
                  f"model {share * allreduce_seconds(4, n, net) * 1e6:.0f} us; 1 MiB measured "
                  f"{row['allreduce_1MiB_us']:.0f} us, model {share * allreduce_seconds(1 << 20, n, net) * 1e6:.0f} us")
    if args.cluster:
        runs = load_cluster_runs(args.cluster.split(","))
        emu = fit_cluster(runs, args.cores)
        print(f"\nemulated cluster fitted on {min(r['hosts'] for r in runs)} hosts: tail "
              f"{emu.tail * 1e3:.0f} ms, {emu.cpu_per_byte * 1e9:.2f} ns of CPU per byte sent, "
              f"{args.cores} cores shared")
        print("hosts | ring bound s | measured s | CPU s measured | CPU s / cores | model s | model error")
        for run in sorted(runs, key=lambda r: r["hosts"]):
            model = emulated_allreduce_seconds(run["size_bytes"], run["hosts"], emu)
            cpu = run_cpu_seconds(run)
            print(f"{run['hosts']} | {run['bound_s']:.3f} | {run['best_s']:.3f} | {cpu:.2f} | "
                  f"{cpu / args.cores:.2f} | {model:.3f} | {100 * (model / run['best_s'] - 1):+.0f}%")
    print(f"\n100 Gbit/s links, {args.per_host} workers per host, hierarchical allreduce; scaling efficiency:")
    print("model | 8 workers | 64 workers | 512 workers")
    for model in (RESNET50, BERT_LARGE):
        cells = [f"{100 * efficiency(model, w, args.per_host, DATACENTRE_100G, engine):.1f}%" for w in (8, 64, 512)]
        print(f"{model.name} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
