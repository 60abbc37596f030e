#!/usr/bin/env python
"""How ``hora run`` over SSH starts, runs and stops as the cluster grows (emulated hosts x 4 ranks).

The one-host launcher measurement (``scaling_one_host.py --launcher``) leaves out what only a
multi-host job has: one ssh client per remote rank, sshd sessions, the remote wrapper, and hora's
rendezvous across the hosts. This builds one emulated cluster of ``max(--emulated-hosts)`` hosts
(network namespaces with sshd, tests/cluster/emucluster.py; needs root) once and, for each host
count H, runs ``hora run -np 4H -H <first H hosts>:4`` of a worker that calls ``hora.init()``, does
one 4-byte ``hora.allreduce``, prints one line and sleeps ``--sleep`` seconds. Per run:

- start-up: launch until every rank's line came back through the launcher (so it includes SSH
  log-in, the rendezvous, the first allreduce and output routing);
- the launcher's threads (/proc/PID/task) and its ssh client processes (children named after the
  ssh program) while every rank runs, the launcher's own CPU seconds up to then, and how many of
  the machine's cores were busy over the start-up (all processes, /proc/stat; near the core count
  means the start-up was CPU-bound); from the ranks' lines, when the first and last rank's script
  began, the median time to import hora and to ``hora.init()``, and the ranks' CPU seconds summed;
- exit: launch until ``hora run`` returned (the sleep included).

``--failure`` adds, at the largest size, runs where rank ``--kill-rank`` (37) SIGKILLs itself right
after its line while the others sleep ``--failure-sleep`` s: how long from the kill until ``hora run``
exited, its status, and whether its message names the rank and its host.

    python benchmarks/scaling_cluster_launch.py                          # 2,4,8,16 hosts x 4, 1 round
    python benchmarks/scaling_cluster_launch.py --rounds 3 --failure --json
    python benchmarks/scaling_cluster_launch.py --emulated-hosts 2 --ranks-per-host 2 --sleep 1

All hosts share this machine's cores: 64 ranks are 64 Python interpreters (plus 64 ssh clients
and 64 sshd sessions) on however many cores there are, so start-up here is an upper bound for a
real cluster, where each host starts its own ranks on its own cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from cluster_allreduce import _machine_cpu  # noqa: E402 - importable once HERE is on sys.path
from scaling_one_host import format_table, threads_of, wait_for_rank_lines  # noqa: E402 - the same

# argv[1]: the rank that kills itself (-1: none); argv[2]: seconds to sleep after the line. The line
# says when the interpreter began the script, had imported hora, was initialised and had done the
# allreduce, the rank's CPU seconds so far, and (last) when it printed.
WORKER = (
    "import os, resource, signal, sys, time\n"
    "t0 = time.time()\n"
    "import numpy as np\n"
    "import hora\n"
    "t1 = time.time()\n"
    "hora.init()\n"
    "t2 = time.time()\n"
    "hora.allreduce(np.ones(1, np.float32), name='launch.probe')\n"
    "t3 = time.time()\n"
    "use = resource.getrusage(resource.RUSAGE_SELF)\n"
    "print('up', hora.rank(), *map(repr, (t0, t1, t2, t3, use.ru_utime + use.ru_stime, time.time())),\n"
    "      flush=True)\n"
    "if hora.rank() == int(sys.argv[1]):\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "time.sleep(float(sys.argv[2]))\n"
    "hora.shutdown()\n"
)
MARKER = "<stdout>:up "


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (its threads, not its children)."""
    fields = _stat_fields(pid)  # fields[0] is the state (field 3): utime is field 14, stime 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_named(pid: int, name: str) -> int:
    """Live child processes of ``pid`` whose command name is ``name`` (the launcher's ssh clients)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
            fields = _stat_fields(int(entry))
        except OSError:
            continue
        if comm == name and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            count += 1
    return count


def measure_launch(hosts: list[str], ssh_flags: list[str], interfaces: str | None, ranks_per_host: int,
                   sleep_s: float, kill_rank: int = -1, timeout: float = 600.0,
                   python_path: str | None = None) -> dict[str, Any]:
    """One ``hora run`` of WORKER on ``hosts`` x ``ranks_per_host``; the numbers described above."""
    n = len(hosts) * ranks_per_host
    argv = [sys.executable, "-m", "hora", "run", "-np", str(n),
            "-H", ",".join(f"{h}:{ranks_per_host}" for h in hosts), *ssh_flags]
    if interfaces:
        argv += ["--network-interfaces", interfaces]
    argv += [sys.executable, "-c", WORKER, str(kill_rank), str(sleep_s)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update({"OMP_NUM_THREADS": "1", "HORA_START_TIMEOUT": "300"})
    if python_path:
        env["PYTHONPATH"] = python_path
    ssh_program = os.path.basename((env.get("HORA_SSH_COMMAND") or "ssh").split()[0])
    with tempfile.TemporaryFile("w+") as err:
        machine_before = _machine_cpu()
        launched, launched_wall = time.perf_counter(), time.time()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env, text=True,
                                cwd=str(REPO))
        watchdog = threading.Timer(timeout, proc.kill)  # its ssh clients die with it (PDEATHSIG)
        watchdog.start()
        try:
            assert proc.stdout is not None
            seen = wait_for_rank_lines(proc.stdout, n, MARKER)
            startup = time.perf_counter() - launched
            machine = {k: v - machine_before[k] for k, v in _machine_cpu().items()}
            threads, ssh = threads_of(proc.pid), children_named(proc.pid, ssh_program)
            launcher_cpu = cpu_seconds(proc.pid)
            proc.stdout.read()
            code = proc.wait()
            exited_at, exit_s = time.time(), time.perf_counter() - launched
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        stderr = err.read()
    row: dict[str, Any] = {
        "hosts": len(hosts), "ranks": n, "startup_s": startup, "launcher_threads": threads,
        "ssh_clients": ssh, "launcher_cpu_s": launcher_cpu,
        # the machine's busy CPU seconds over the start-up over its length: how many cores it kept busy
        "startup_cores_busy": (sum(machine.values()) - machine["idle"] - machine["iowait"]) / startup,
        "exit_s": exit_s, "ranks_seen": len(seen),
        "exit_code": code}
    stamps = [[float(w) for w in line.split(MARKER, 1)[1].split()[1:]] for line in seen.values()]
    if stamps:
        row.update({
            # launch until the first and the last rank's interpreter began running the script
            "first_rank_started_s": min(t[0] for t in stamps) - launched_wall,
            "last_rank_started_s": max(t[0] for t in stamps) - launched_wall,
            "import_s_median": statistics.median(t[1] - t[0] for t in stamps),
            "init_s_median": statistics.median(t[2] - t[1] for t in stamps),
            "init_s_max": max(t[2] - t[1] for t in stamps),
            "allreduce_s_max": max(t[3] - t[2] for t in stamps),
            "ranks_cpu_s": sum(t[4] for t in stamps)})
    if kill_rank >= 0:
        line = seen.get(f"[{kill_rank}]", "")
        words = line.split(MARKER, 1)[1].split() if line else []
        host = hosts[kill_rank // ranks_per_host]
        lines = [x for x in stderr.splitlines() if x.strip()]
        named = [x for x in lines if x.startswith("hora run: rank ")]
        message = named[-1] if named else (lines[-1] if lines else "")
        row.update({"kill_rank": kill_rank, "killed_on": host,
                    "kill_to_exit_s": exited_at - float(words[-1]) if words else None,
                    "message": message, "names_rank_and_host": f"rank {kill_rank} on {host}" in message})
    return row


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per host count: start-up and exit best / median, the largest thread and ssh counts."""
    table = []
    for hosts in sorted({r["hosts"] for r in rows}):
        mine = [r for r in rows if r["hosts"] == hosts]
        starts, exits = [r["startup_s"] for r in mine], [r["exit_s"] for r in mine]
        table.append({
            "hosts": hosts, "ranks": mine[0]["ranks"], "runs": len(mine),
            "startup_best_s": min(starts), "startup_median_s": statistics.median(starts),
            "launcher_threads": max(r["launcher_threads"] for r in mine),
            "ssh_clients": max(r["ssh_clients"] for r in mine),
            "launcher_cpu_s": statistics.median(r["launcher_cpu_s"] for r in mine),
            "startup_cores_busy": statistics.median(r["startup_cores_busy"] for r in mine),
            "last_rank_started_median_s": statistics.median(r["last_rank_started_s"] for r in mine),
            "ranks_cpu_median_s": statistics.median(r["ranks_cpu_s"] for r in mine),
            "exit_best_s": min(exits), "exit_median_s": statistics.median(exits),
            "all_ok": all(r["exit_code"] == 0 and r["ranks_seen"] == r["ranks"] for r in mine)})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emulated-hosts", default="2,4,8,16", help="host counts, comma-separated")
    parser.add_argument("--ranks-per-host", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each size, taken in turn")
    parser.add_argument("--sleep", type=float, default=5.0, help="seconds each rank sleeps after its line")
    parser.add_argument("--failure", action="store_true",
                        help="also one run per round at the largest size with --kill-rank SIGKILLed")
    parser.add_argument("--kill-rank", type=int, default=37)
    parser.add_argument("--failure-sleep", type=float, default=60.0,
                        help="the other ranks' sleep in a failure run (longer than detection can take)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--python-path", help="PYTHONPATH for launcher and workers (another checkout's src)")
    parser.add_argument("--json", action="store_true", help="print every run and the summary as JSON")
    args = parser.parse_args(argv)
    sizes = [int(h) for h in args.emulated_hosts.split(",")]
    largest = max(sizes)
    if args.failure and not 0 <= args.kill_rank < largest * args.ranks_per_host:
        parser.error(f"--kill-rank {args.kill_rank} is not a rank of {largest} x {args.ranks_per_host}")

    sys.path.insert(0, str(REPO / "tests" / "cluster"))
    from emucluster import ClusterUnavailable, EmulatedCluster

    rows: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    try:
        with EmulatedCluster(largest, rate="1gbit", tcp_congestion="reno") as cluster:
            cluster.check_ssh()
            addresses = [h.address for h in cluster.hosts]
            common = (cluster.ssh_flags(), cluster.interfaces_flag(), args.ranks_per_host)
            for _ in range(args.rounds):
                for hosts in sizes:
                    rows.append(measure_launch(addresses[:hosts], *common, args.sleep, timeout=args.timeout,
                                               python_path=args.python_path))
                    if not args.json:
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                if args.failure:
                    failures.append(measure_launch(addresses, *common, args.failure_sleep, args.kill_rank,
                                                   args.timeout, args.python_path))
                    if not args.json:
                        print(json.dumps(failures[-1]), file=sys.stderr, flush=True)
    except ClusterUnavailable as exc:
        raise SystemExit(f"scaling_cluster_launch: cannot emulate a cluster here: {exc}") from None
    summary = summarize(rows)
    if args.json:
        print(json.dumps({"runs": rows, "summary": summary, "failures": failures}, indent=1))
        return 0
    print(format_table(summary, ("hosts", "ranks", "runs", "startup_best_s", "startup_median_s",
                                 "launcher_threads", "ssh_clients", "launcher_cpu_s", "startup_cores_busy",
                                 "last_rank_started_median_s", "ranks_cpu_median_s", "exit_best_s",
                                 "exit_median_s", "all_ok")))
    for row in failures:
        print(f"rank {row['kill_rank']} on {row['killed_on']} SIGKILLed: hora run exited "
              f"{row['kill_to_exit_s']:.2f} s later with status {row['exit_code']}; "
              f"names rank and host: {row['names_rank_and_host']}; message: {row['message']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
