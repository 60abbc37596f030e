#!/usr/bin/env python
"""How hora's costs grow with the number of ranks on one host (oversubscribed cores are fine: the
point is growth, not speed).

For each world size: start-up time (launch to every rank initialised), 4-byte and 1 MiB allreduce
time (mean per call, slowest rank), the steady-state engine cycle time (a cached 4-byte allreduce
submitted and awaited back to back, which is one negotiation cycle plus the transport), and per
process the open sockets and threads (largest over the ranks), the TCP peers a process connected to,
and the point-to-point messages per rank of one steady-state cycle (the control-plane cost; with the
shm transport the cycle's allreduce goes through shared memory and sends no messages). Each size is
one fresh job started by ``hora.run``.

    python benchmarks/scaling_one_host.py                    # 2, 4, 8, 16, 32, 64 ranks
    python benchmarks/scaling_one_host.py --sizes 2,4,8 --json
    python benchmarks/scaling_one_host.py --transport tcp    # HORA_TRANSPORT=tcp: the TCP mesh
    python benchmarks/scaling_one_host.py --launcher         # `hora run -np N` of a trivial script

``--launcher`` measures the launcher alone, without hora in the workers: ``hora run -np N`` of a
script that prints one line and sleeps 8 s (so every rank still runs when the threads are
counted). "start-up" is launch until every rank's line came back through the launcher (so it
includes output routing), the threads are the launcher's while all ranks run, "exit" is launch
until ``hora run`` returned, and "spawn" the time this process takes to start N ``/bin/true`` the
way the launcher starts a worker (its own sequential share of the start-up).
``--launcher-python-path DIR`` runs the launcher from another checkout's ``src`` (to compare with an
older commit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import IO, Any


def _sockets_and_threads() -> tuple[int, int]:
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                sockets += 1
        except OSError:
            pass
    with open("/proc/self/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return sockets, threads


def _tcp_of(comm: Any) -> Any:
    """The TCP communicator behind the engine's world: itself, or the one shm holds for objects."""
    from hora.transport.tcp import TcpCommunicator

    if isinstance(comm, TcpCommunicator):
        return comm
    inner = getattr(comm, "_mesh", None)
    return inner if isinstance(inner, TcpCommunicator) else None


def worker(launched_at: float, small_iters: int, big_iters: int) -> dict[str, Any] | None:
    import numpy as np

    import hora

    hora.init()
    ready = time.time() - launched_at
    hora.barrier()

    def timed(buf: np.ndarray, iters: int, name: str) -> float:
        for _ in range(3):
            hora.allreduce(buf, name=name)
        hora.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            hora.allreduce(buf, name=name)
        return (time.perf_counter() - start) / iters

    small = timed(np.ones(1, np.float32), small_iters, "scaling.small")
    big = timed(np.ones(256 * 1024, np.float32), big_iters, "scaling.big")
    sockets, threads = _sockets_and_threads()
    engine = hora.basics.engine()
    tcp = _tcp_of(engine._sets[0].comm)  # a benchmark may look inside: the engine's world set
    rounds_before = engine.negotiation_rounds
    sent_before = tcp.small_messages_sent if tcp is not None else 0
    cycle = timed(np.ones(1, np.float32), small_iters, "scaling.small")  # cached: no name rounds
    name_rounds = engine.negotiation_rounds - rounds_before
    # Each timed allreduce is one cycle's control exchange plus the 4-byte allreduce itself (plus 3
    # warm-up calls and a barrier); per call that is an upper bound on the control messages.
    messages = (tcp.small_messages_sent - sent_before) / (small_iters + 4) if tcp is not None else 0.0
    peers = len(tcp.connected_peers()) if tcp is not None else 0
    rows = hora.allgather_object({"ready": ready, "small": small, "big": big, "cycle": cycle,
                                  "sockets": sockets, "threads": threads, "name_rounds": name_rounds,
                                  "messages": messages, "peers": peers})
    rank = hora.rank()
    hora.shutdown()
    if rank != 0:
        return None
    return {"ranks": len(rows), "startup_s": max(r["ready"] for r in rows),
            "allreduce_4B_us": max(r["small"] for r in rows) * 1e6,
            "allreduce_1MiB_us": max(r["big"] for r in rows) * 1e6,
            "cached_cycle_us": max(r["cycle"] for r in rows) * 1e6,
            "name_rounds_in_steady_state": max(r["name_rounds"] for r in rows),
            "sockets_per_process": max(r["sockets"] for r in rows),
            "threads_per_process": max(r["threads"] for r in rows),
            "tcp_peers_per_process": max(r["peers"] for r in rows),
            "p2p_msgs_per_call": max(r["messages"] for r in rows)}


def measure(n: int, transport: str | None, small_iters: int, big_iters: int) -> dict[str, Any]:
    import hora

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update({"OMP_NUM_THREADS": "1", "HORA_START_TIMEOUT": "300"})
    if transport:
        env["HORA_TRANSPORT"] = transport
    launched = time.time()
    result = hora.run(worker, args=(launched, small_iters, big_iters), np=n, env=env)[0]
    result["job_s"] = time.time() - launched
    return result


_LAUNCHED_SCRIPT = "import time; print('up', flush=True); time.sleep(8)"


def threads_of(pid: int) -> int:
    """Threads of process ``pid`` now (also used by scaling_cluster_launch.py)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def wait_for_rank_lines(stream: IO[str], n: int, marker: str = "<stdout>:up") -> dict[str, str]:
    """Read a launcher's output until ``n`` ranks each sent a line containing ``marker``; rank
    prefix (``[3]``) -> that line. Fewer when the launcher's output ends first."""
    seen: dict[str, str] = {}
    for line in stream:
        if marker in line:
            seen.setdefault(line.split("]", 1)[0] + "]", line.rstrip("\n"))
            if len(seen) == n:
                break
    return seen


def measure_launcher(n: int, python_path: str | None) -> dict[str, Any]:
    """Time ``hora run -np n`` of a trivial script and count the launcher's threads meanwhile."""
    import subprocess

    from hora.runner.launching.process import spawn

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    started = time.perf_counter()  # the launcher's own share: starting n processes as it does
    children = [spawn(["/bin/true"], env) for _ in range(n)]
    spawn_s = time.perf_counter() - started
    for child in children:
        child.communicate()
    if python_path:
        env["PYTHONPATH"] = python_path
    launched = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hora", "run", "-np", str(n), sys.executable, "-c",
                             _LAUNCHED_SCRIPT], stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout is not None
    seen = wait_for_rank_lines(proc.stdout, n)
    startup = time.perf_counter() - launched
    threads = threads_of(proc.pid)
    proc.stdout.read()
    code = proc.wait(timeout=600)
    return {"ranks": n, "launcher_startup_s": startup, "spawn_s": spawn_s, "launcher_threads": threads,
            "exit_s": time.perf_counter() - launched, "ranks_seen": len(seen), "exit_code": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2,4,8,16,32,64")
    parser.add_argument("--transport", choices=("shm", "tcp"), default=None)
    parser.add_argument("--small-iters", type=int, default=200)
    parser.add_argument("--big-iters", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--launcher", action="store_true", help="time `hora run` alone (see above)")
    parser.add_argument("--launcher-python-path", default=None)
    args = parser.parse_args()
    if args.launcher:
        rows = [measure_launcher(int(n), args.launcher_python_path) for n in args.sizes.split(",")]
        cols: tuple[str, ...] = ("ranks", "launcher_startup_s", "spawn_s", "exit_s", "launcher_threads",
                                 "ranks_seen", "exit_code")
        print(json.dumps(rows, indent=1) if args.json else format_table(rows, cols))
        return 0
    rows = [measure(int(n), args.transport, args.small_iters, args.big_iters) for n in args.sizes.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    cols = ("ranks", "startup_s", "allreduce_4B_us", "allreduce_1MiB_us", "cached_cycle_us",
            "sockets_per_process", "threads_per_process", "name_rounds_in_steady_state",
            "tcp_peers_per_process", "p2p_msgs_per_call")
    print(format_table(rows, cols))
    return 0


def format_table(rows: list[dict[str, Any]], cols: tuple[str, ...]) -> str:
    lines = [" | ".join(cols)]
    for row in rows:
        lines.append(" | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else f"{row[c]}" for c in cols))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
