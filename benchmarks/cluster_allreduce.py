#!/usr/bin/env python
"""How close hora's allreduce gets to the network's limit across hosts.

A ring allreduce of S bytes over p hosts must move 2(p-1)/p * S bytes through every host's link, so
on links of B bytes/s no allreduce can take less than the *ring bound* ``2(p-1)/p * S / B``. This
script runs one rank per host, times a float32 allreduce of ``--size-mib`` (default 64 MiB) through
hora's engine (slowest rank wins, best and median of ``--iters``), and reports that time as a
multiple of the bound (1.00x would be line rate) and the bus bandwidth it implies.

By default it builds its own cluster (needs root): 4 network-namespace hosts with sshd, each behind a
link shaped to 1 Gbit/s with ``tc tbf`` (tests/cluster/emucluster.py), launched with
``hora run -H ...`` over SSH from the root namespace. On one machine all hosts share its cores, so
the reduction arithmetic and the kernel's copies compete with each other, which a real cluster
would not have. Given ``--hosts`` it runs on an existing cluster instead (real or emulated).

    python benchmarks/cluster_allreduce.py                          # 4 emulated hosts, 1 Gbit/s, 64 MiB
    python benchmarks/cluster_allreduce.py --link-gbit 0.5 --size-mib 32 --iters 5
    python benchmarks/cluster_allreduce.py --emulated-hosts 2 --ranks-per-host 2 --compare-hierarchical
    python benchmarks/cluster_allreduce.py --hosts h1,h2,h3,h4 -p 22 -i ~/.ssh/id_ed25519 \\
        --network-interfaces eth0 --link-gbit 10                    # a real cluster
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


def ring_bound_seconds(size_bytes: int, ranks: int, link_bytes_per_s: float) -> float:
    """The least time a ring allreduce of ``size_bytes`` can take over links of that speed."""
    return 2 * (ranks - 1) / ranks * size_bytes / link_bytes_per_s


def _machine_cpu() -> dict[str, float]:
    """Machine-wide CPU seconds so far by kind (/proc/stat), to see what else burns the cores:
    softirq is the kernel's packet processing (veth, bridge, tc), which no rank is charged for."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {name: int(value) / tick for name, value in zip(names, fields)}


def worker(size_mib: float, iters: int, warmup: int, out: str, in_place: bool = False) -> int:
    """One rank: time ``iters`` allreduces (slowest rank per iteration); rank 0 writes the list."""
    import numpy as np

    import hora

    hora.init()
    data = np.ones(int(size_mib * MiB) // 4, dtype=np.float32)
    for _ in range(warmup):
        hora.allreduce(data, op=hora.Sum, name="cluster_allreduce")
    times, cpu_fractions, machine = [], [], []
    for _ in range(iters):
        if in_place:
            data[...] = 1  # untimed: every iteration sums ones again
        hora.barrier()
        machine_before = _machine_cpu()
        usage_before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        if in_place:
            # Into the input's own memory: no fresh 64 MiB output whose first touch the kernel must
            # zero (a huge-page fault per 2 MiB), which out-of-place NumPy results pay on every call.
            result = hora.allreduce_(data, op=hora.Sum, name="cluster_allreduce")
        else:
            result = hora.allreduce(data, op=hora.Sum, name="cluster_allreduce")
        elapsed = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = [usage.ru_utime - usage_before.ru_utime, usage.ru_stime - usage_before.ru_stime,
               usage.ru_nvcsw - usage_before.ru_nvcsw, usage.ru_nivcsw - usage_before.ru_nivcsw]
        machine.append({k: v - machine_before[k] for k, v in _machine_cpu().items()})
        # Slowest rank's wall time, and all ranks' CPU seconds (user + system, every thread) summed.
        summed = hora.allreduce(np.array(cpu, dtype=np.float64), op=hora.Sum, name="cpu_sum")
        slowest = float(hora.allreduce(np.array([elapsed]), op=hora.Max, name="slowest")[0])
        times.append(slowest)
        cpu_fractions.append({"user_s": float(summed[0]), "system_s": float(summed[1]),
                              "voluntary_switches": int(summed[2]), "involuntary_switches": int(summed[3])})
    ok = bool(result[0] == hora.size() and result[-1] == hora.size())
    if hora.rank() == 0:
        best = min(range(iters), key=times.__getitem__)
        Path(out).write_text(json.dumps({"times": times, "ranks": hora.size(), "correct": ok,
                                         "bytes": int(data.nbytes), "in_place": in_place,
                                         # all ranks' CPU seconds and context switches, best iteration
                                         "ranks_cpu": cpu_fractions[best],
                                         # the machine's CPU seconds by kind over that iteration
                                         "machine_cpu_s": machine[best]}))
    hora.shutdown()
    return 0 if ok else 1


def launch(hosts: list[str], ssh_flags: list[str], interfaces: str | None, args: argparse.Namespace,
           out: str, hierarchical: bool | None = None) -> None:
    slots = args.ranks_per_host
    argv = [sys.executable, "-m", "hora", "run", "-np", str(len(hosts) * slots),
            "-H", ",".join(f"{h}:{slots}" for h in hosts), *ssh_flags]
    if interfaces:
        argv += ["--network-interfaces", interfaces]
    argv += [sys.executable, str(Path(__file__).resolve()), "--worker", out,
             "--size-mib", str(args.size_mib), "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if args.in_place:
        argv.append("--in-place")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    for knob in args.knob:
        name, _, value = knob.partition("=")
        env[f"HORA_{name.upper()}"] = value
    if hierarchical is not None:
        env["HORA_HIERARCHICAL_ALLREDUCE"] = "1" if hierarchical else "0"
    result = subprocess.run(argv, cwd=str(REPO), env=env, capture_output=True, text=True,
                            timeout=args.timeout)
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"cluster_allreduce: the job failed with status {result.returncode}")


def report(data: dict, link_gbit: float, where: str, as_json: bool, hosts: int | None = None,
           label: str = "") -> dict:
    ranks, size = data["ranks"], data["bytes"]
    hosts = hosts or ranks
    # What each host's link must carry at the least, however many ranks share the host.
    bound = ring_bound_seconds(size, hosts, link_gbit * 1e9 / 8)
    best, median = min(data["times"]), statistics.median(data["times"])
    row = {
        "size_bytes": size, "ranks": ranks, "link_gbit": link_gbit, "iters": len(data["times"]),
        "bound_s": bound, "best_s": best, "median_s": median,
        "best_over_bound": best / bound, "median_over_bound": median / bound,
        "busbw_gbit": 2 * (hosts - 1) / hosts * size * 8 / best / 1e9,
        "correct": data["correct"], "where": where, "hosts": hosts, "label": label,
        "in_place": data.get("in_place", False), "ranks_cpu": data.get("ranks_cpu"),
        "machine_cpu_s": data.get("machine_cpu_s"),
    }
    if as_json:
        print(json.dumps(row))
        return row
    print(f"hora allreduce{label}, float32, {hosts} hosts x {ranks // hosts} rank(s), "
          f"links {link_gbit:g} Gbit/s ({where})")
    print(f"{'size':>10} {'ring bound':>11} {'best':>9} {'median':>9} {'best/bound':>11} "
          f"{'median/bound':>13} {'busbw':>12}")
    print(f"{size / MiB:>6.0f} MiB {bound * 1e3:>8.1f} ms {best * 1e3:>6.1f} ms {median * 1e3:>6.1f} ms "
          f"{row['best_over_bound']:>10.2f}x {row['median_over_bound']:>12.2f}x "
          f"{row['busbw_gbit']:>6.3f} Gbit/s")
    print(f"best time = {row['best_over_bound']:.2f} x the ring bound "
          f"(hora reaches {100 / row['best_over_bound']:.0f}% of what the links allow)")
    if row["ranks_cpu"] is not None:
        cpu = row["ranks_cpu"]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in (row["machine_cpu_s"] or {}).items() if v >= 0.01)
        print(f"all ranks on the best run: user {cpu['user_s']:.2f} s, system {cpu['system_s']:.2f} s, "
              f"{cpu['voluntary_switches']} voluntary and {cpu['involuntary_switches']} involuntary "
              f"context switches; the machine's CPU seconds then: {kinds}")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--link-gbit", type=float, default=1.0,
                        help="link speed: what the emulated links are shaped to, or what yours are")
    parser.add_argument("--emulated-hosts", type=int, default=4,
                        help="hosts of the emulated cluster (without --hosts)")
    parser.add_argument("--hosts", help="comma-separated hosts of an existing cluster, one rank each")
    parser.add_argument("-p", "--ssh-port", type=int)
    parser.add_argument("-i", "--ssh-identity-file")
    parser.add_argument("--network-interfaces")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--compare-hierarchical", action="store_true",
                        help="run flat ring and hierarchical allreduce on the same cluster, alternating "
                             "--rounds times, and print both and their ratio")
    parser.add_argument("--rounds", type=int, default=2, help="alternations with --compare-hierarchical")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the job may take")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                        help="a hora setting for the workers, e.g. ring_chunk_bytes=4194304 (HORA_NAME)")
    parser.add_argument("--in-place", action="store_true",
                        help="hora.allreduce_ (the result overwrites the input) instead of hora.allreduce")
    parser.add_argument("--unshaped", action="store_true",
                        help="emulated links without tc (the bound is still computed at --link-gbit): "
                             "what the CPU alone allows, to tell the shaping's cost from hora's")
    parser.add_argument("--tcp-congestion",
                        help="the emulated hosts' TCP congestion control (default reno: ACK-clocked like "
                             "a usual host's CUBIC; 'default' keeps what a namespace gets from this "
                             "machine, BBR here, whose pacing timers all hosts pay on the shared cores); "
                             "emulated cluster only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.size_mib, args.iters, args.warmup, args.worker, args.in_place)

    with tempfile.TemporaryDirectory(prefix="hora-cluster-bench-") as tmp:
        out = os.path.join(tmp, "times.json")
        if args.hosts:
            if args.tcp_congestion:
                parser.error("--tcp-congestion sets the emulated hosts' TCP; with --hosts configure "
                             "your hosts' net.ipv4.tcp_congestion_control yourself")
            flags = []
            if args.ssh_port:
                flags += ["-p", str(args.ssh_port)]
            if args.ssh_identity_file:
                flags += ["-i", args.ssh_identity_file]
            hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
            where = "given hosts"
            if args.compare_hierarchical:
                return compare_hierarchical(hosts, flags, args.network_interfaces, args, out, where)
            launch(hosts, flags, args.network_interfaces, args, out)
        else:
            sys.path.insert(0, str(REPO / "tests" / "cluster"))
            from emucluster import ClusterUnavailable, EmulatedCluster

            rate = f"{int(round(args.link_gbit * 1000))}mbit"
            where = "emulated: network namespaces, tc tbf on both ends of each veth, sshd"
            try:
                if args.unshaped:
                    rate, where = None, "emulated, links NOT shaped (CPU-bound reference)"
                congestion = args.tcp_congestion or "reno"
                congestion = None if congestion == "default" else congestion
                where += f", TCP congestion control {congestion or 'the machine default'}"
                with EmulatedCluster(args.emulated_hosts, rate=rate, tcp_congestion=congestion) as cluster:
                    hosts = [h.address for h in cluster.hosts]
                    if args.compare_hierarchical:
                        return compare_hierarchical(hosts, cluster.ssh_flags(), cluster.interfaces_flag(),
                                                    args, out, where)
                    launch(hosts, cluster.ssh_flags(), cluster.interfaces_flag(), args, out)
            except ClusterUnavailable as exc:
                raise SystemExit(f"cluster_allreduce: cannot emulate a cluster here: {exc}") from None
        report(json.loads(Path(out).read_text()), args.link_gbit, where, args.json, hosts=len(hosts))
    return 0


def compare_hierarchical(hosts: list[str], flags: list[str], interfaces: str | None,
                         args: argparse.Namespace, out: str, where: str) -> int:
    """Flat ring and hierarchical allreduce, taking turns on the same cluster; best of each."""
    best: dict[bool, dict] = {}
    for _ in range(args.rounds):
        for hierarchical in (False, True):
            launch(hosts, flags, interfaces, args, out, hierarchical=hierarchical)
            data = json.loads(Path(out).read_text())
            if hierarchical not in best or min(data["times"]) < min(best[hierarchical]["times"]):
                best[hierarchical] = data
    rows = {h: report(best[h], args.link_gbit, where, args.json, hosts=len(hosts),
                      label=" (hierarchical)" if h else " (flat ring)") for h in (False, True)}
    ratio = rows[False]["best_s"] / rows[True]["best_s"]
    if args.json:
        print(json.dumps({"flat_over_hierarchical": ratio}))
    else:
        print(f"hierarchical is {ratio:.2f}x as fast as the flat ring (best of {args.rounds} rounds each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
