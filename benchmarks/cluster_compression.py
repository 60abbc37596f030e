#!/usr/bin/env python
"""Training speed with gradient compression on slow links: hora uncompressed, hora with PowerSGD,
and PyTorch DDP (Gloo) with and without its PowerSGD hook, on the same emulated cluster in one run.

By default it builds its own cluster (needs root, as benchmarks/cluster_allreduce.py does): network
namespace hosts with sshd, each behind a link shaped with ``tc tbf`` to ``--link-gbit`` (1 Gbit/s),
one rank per host, launched with ``hora run -H`` over SSH. Every contender trains the same model
(ResNet-18 on 64x64 images with batch 16 per worker, or the 200-tensor MLP with batch 32; SGD with
momentum) from the same seed on a synthetic batch, with PowerSGD at rank ``--rank`` after
``--start-iter`` plain steps (hora's ``Compression.powersgd`` and DDP's ``powerSGD_hook`` alike).
After the warm-up steps (at least ``--start-iter``, so the timed steps are all compressed) each run
times ``--steps`` steps; the slowest rank's time gives images per second of all workers, and hora's
runs also report the bytes per step and rank its transports counted (``hora.bytes_sent()``).
Contenders take turns for ``--rounds`` rounds and the median is reported. The issue's bars:
``powersgd(rank=4)`` at least 2x uncompressed hora, and at least DDP's PowerSGD hook on the same links.

DDP's PowerSGD run puts every gradient in one bucket: with DDP's default buckets its Gloo
collectives were seen to cross between ranks on ResNet-18 and abort the job (see ``worker``).

All hosts share this machine's cores, so compute is slower than on a real cluster of the same size
(each rank's backward pass competes with the others'), which makes compression's gain smaller here
than on hosts of their own.

    python benchmarks/cluster_compression.py                         # 2 and 4 hosts, 1 Gbit/s, both models
    python benchmarks/cluster_compression.py --hosts-list 2 --models resnet18 --rounds 3 --json
    python benchmarks/cluster_compression.py --hosts h1,h2,h3,h4 -i ~/.ssh/id_ed25519 --network-interfaces eth0
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rank_sync import gloo_sync, hora_sync
from synthetic_models import SHAPES, comma_list, model_and_batch

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("hora", "hora-powersgd", "ddp", "ddp-powersgd")
MODELS = tuple(SHAPES)


def worker(out: str, contender: str, model_name: str, steps: int, warmup: int, rank: int, start_iter: int,
           master: str) -> int:
    """One rank of one contender: train, time, and (rank 0) write the figures to ``out``."""
    import torch
    import torch.nn.functional as F

    from hora import config

    torch.set_num_threads(1)
    me, size = int(config.get("rank")), int(config.get("size"))
    model, data, target = model_and_batch(model_name, seed=42)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    bytes_sent = None
    if contender.startswith("ddp"):
        from datetime import timedelta

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=me, world_size=size,
                                timeout=timedelta(seconds=300))
        if contender == "ddp-powersgd":
            # One bucket: with several, the hook's second allreduce of one bucket (issued from a
            # future's callback, on whichever thread completed it) and the first of the next were
            # seen to reach Gloo in different orders on different ranks (ResNet-18, 2 hosts:
            # "Received data size doesn't match expected size", then SIGABRT).
            trained = DistributedDataParallel(model, bucket_cap_mb=1024)
        else:
            trained = DistributedDataParallel(model)
        if contender == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                                start_powerSGD_iter=start_iter)
            trained.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        sync = gloo_sync()
    else:
        import hora
        import hora.torch as hvd

        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = (hvd.Compression.powersgd(rank=rank, start_iter=start_iter) if contender == "hora-powersgd"
                       else hvd.Compression.none)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)
        trained = model
        sync = hora_sync()
        bytes_sent = hora.bytes_sent

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(trained(data), target).backward()
        optimizer.step()

    for _ in range(max(warmup, start_iter if contender.endswith("powersgd") else 0)):
        step()
    sync.barrier()
    sent_before = bytes_sent() if bytes_sent else None
    started = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = sync.slowest(time.perf_counter() - started)
    result: dict[str, Any] = {"seconds": seconds, "images_per_second": len(data) * size * steps / seconds}
    sent_after = bytes_sent() if bytes_sent else None
    if sent_after is not None and sent_before is not None:
        result["bytes_per_step"] = (sent_after - sent_before) / steps
    sync.barrier()
    sync.done()
    if me == 0:
        Path(out).write_text(json.dumps(result))
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Cluster:
    """Where the runs go: host addresses, ``hora run``'s SSH flags, and its --network-interfaces value
    (the first interface is the one the hosts' Gloo uses)."""

    addresses: list[str]
    ssh_flags: list[str]
    interfaces: str


def launch(cluster: Cluster, hosts: int, contender: str, model: str, args: argparse.Namespace, out: str) -> dict:
    addresses = cluster.addresses[:hosts]
    argv = [sys.executable, "-m", "hora", "run", "-np", str(hosts), "-H", ",".join(f"{a}:1" for a in addresses),
            *cluster.ssh_flags, "--network-interfaces", cluster.interfaces,
            sys.executable, str(Path(__file__).resolve()), "--worker", out, "--contender", contender,
            "--model", model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--rank", str(args.rank),
            "--start-iter", str(args.start_iter), "--master", f"{addresses[0]}:{_free_port()}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": cluster.interfaces.split(",")[0]})
    try:
        result = subprocess.run(argv, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        seen = (exc.stdout or b"")[-4000:] + (exc.stderr or b"")[-4000:]
        sys.stderr.write(seen.decode(errors="replace") if isinstance(seen, bytes) else seen)
        raise SystemExit(f"cluster_compression: {contender} on {hosts} hosts ({model}) did not finish within "
                         f"--timeout {args.timeout:g} s") from None
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise SystemExit(f"cluster_compression: {contender} on {hosts} hosts failed with status {result.returncode}")
    return json.loads(Path(out).read_text())


def measure_on(cluster: Cluster, args: argparse.Namespace, worlds: list[int], models: list[str],
               chosen: list[str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hora-cluster-compression-") as tmp:
        out = os.path.join(tmp, "result.json")
        for hosts in worlds:
            for model in models:
                runs: dict[str, list[dict]] = {c: [] for c in chosen}
                for _ in range(args.rounds):
                    for contender in chosen:  # in turns: the machine's noise falls on all alike
                        runs[contender].append(launch(cluster, hosts, contender, model, args, out))
                rows = {}
                for contender, results in runs.items():
                    row = {"img_sec": statistics.median(r["images_per_second"] for r in results),
                           "rounds": [r["images_per_second"] for r in results]}
                    sent = [r["bytes_per_step"] for r in results if "bytes_per_step" in r]
                    if sent:
                        row["bytes_per_step"] = statistics.median(sent)
                    rows[contender] = row
                ratios = {}
                for a, b in (("hora-powersgd", "hora"), ("hora-powersgd", "ddp-powersgd"), ("hora", "ddp"),
                             ("ddp-powersgd", "ddp")):
                    if a in rows and b in rows:
                        ratios[f"{a}/{b}"] = rows[a]["img_sec"] / rows[b]["img_sec"]
                table.setdefault(str(hosts), {})[model] = {"rows": rows, "ratios": ratios}
    return table


def measure(args: argparse.Namespace, worlds: list[int], models: list[str], chosen: list[str]) -> dict[str, Any]:
    if args.hosts:
        flags = (["-p", str(args.ssh_port)] if args.ssh_port else []) + \
            (["-i", args.ssh_identity_file] if args.ssh_identity_file else [])
        given = Cluster([h.strip() for h in args.hosts.split(",") if h.strip()], flags, args.network_interfaces)
        if len(given.addresses) < max(worlds):
            raise SystemExit(f"cluster_compression: --hosts-list asks for {max(worlds)} hosts, --hosts gives "
                             f"{len(given.addresses)}")
        return measure_on(given, args, worlds, models, chosen)
    sys.path.insert(0, str(REPO / "tests" / "cluster"))
    from emucluster import ClusterUnavailable, EmulatedCluster  # type: ignore[import-not-found]  # tests/cluster

    rate = f"{int(round(args.link_gbit * 1000))}mbit"
    try:
        with EmulatedCluster(max(worlds), rate=rate, tcp_congestion="reno") as emulated:
            own = Cluster([h.address for h in emulated.hosts], emulated.ssh_flags(), emulated.interfaces_flag())
            return measure_on(own, args, worlds, models, chosen)
    except ClusterUnavailable as exc:
        raise SystemExit(f"cluster_compression: cannot emulate a cluster here: {exc}") from None


def format_table(table: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [f"images/s of all workers, median of {args.rounds} round(s); links {args.link_gbit:g} Gbit/s, "
             f"one rank per emulated host; PowerSGD rank {args.rank} after {args.start_iter} plain steps"]
    for hosts, models in table.items():
        for model, entry in models.items():
            cells = []
            for contender, row in entry["rows"].items():
                sent = f" ({row['bytes_per_step'] / 1e6:.2f} MB/step)" if "bytes_per_step" in row else ""
                cells.append(f"{contender} {row['img_sec']:.1f}{sent}")
            lines.append(f"{hosts} hosts, {model}: " + ", ".join(cells))
            lines.append("  " + ", ".join(f"{k} {v:.2f}" for k, v in entry["ratios"].items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hosts-list", default="2,4", help="emulated hosts, one run per count (default 2,4)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    parser.add_argument("--only", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    parser.add_argument("--link-gbit", type=float, default=1.0,
                        help="what the emulated links are shaped to (with --hosts: what yours are, for the record)")
    parser.add_argument("--hosts", help="comma-separated hosts of an existing cluster instead of emulating one")
    parser.add_argument("-p", "--ssh-port", type=int)
    parser.add_argument("-i", "--ssh-identity-file")
    parser.add_argument("--network-interfaces", default="eth0",
                        help="with --hosts: hora run's --network-interfaces; the first is Gloo's (default eth0)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank, hora's and DDP's")
    parser.add_argument("--start-iter", type=int, default=2, help="plain steps before PowerSGD starts")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.contender, args.model, args.steps, args.warmup, args.rank, args.start_iter,
                      args.master)
    chosen = comma_list(parser, args.only, CONTENDERS, "contenders")
    models = comma_list(parser, args.models, MODELS, "models")
    worlds = [int(n) for n in args.hosts_list.split(",") if n]
    table = measure(args, worlds, models, chosen)
    if args.json:
        print(json.dumps({"link_gbit": args.link_gbit, "rank": args.rank, "results": table}, indent=2))
    else:
        print("\n".join(format_table(table, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
