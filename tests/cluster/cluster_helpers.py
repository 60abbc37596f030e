"""Helpers of the emulated-cluster tests: launcher command lines and finding a job's processes.

(Imported by name from the test modules; ``conftest`` holds only fixtures, as several test folders
have a ``conftest`` module.)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from emucluster import EmulatedCluster
from job_env import clean_env  # noqa: F401  (re-exported for the cluster tests)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
JOB = str(HERE / "cluster_job.py")
HORA = [sys.executable, "-m", "hora"]


def hora_run_argv(cluster: EmulatedCluster, np: int, hosts: str, *job_args: str,
                  interfaces: bool = True, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [*HORA, "run", "-np", str(np), "-H", hosts, *cluster.ssh_flags()]
    if interfaces:
        argv += ["--network-interfaces", cluster.interfaces_flag()]
    return [*argv, *extra, sys.executable, *job_args]


def wait_until(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def processes_matching(*needles: str) -> dict[int, str]:
    """Live processes (any namespace: they share the pid space) whose command line or environment
    contains one of ``needles``; pid -> command line."""
    found: dict[int, str] = {}
    wanted = [n.encode() for n in needles]
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        stat = _read(f"/proc/{name}/stat")
        if not stat or stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X", b""):
            continue
        cmdline = _read(f"/proc/{name}/cmdline")
        environ = _read(f"/proc/{name}/environ")
        if any(n in cmdline or n in environ for n in wanted):
            found[int(name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def job_processes(job_id: str) -> dict[int, str]:
    """Every process of a job: remote wrappers carry ``job=<id>`` in their command line, workers
    ``HORA_JOB_ID=<id>`` in their environment."""
    return processes_matching(f"job={job_id}", f"HORA_JOB_ID={job_id}")


def assert_no_job_processes(job_id: str, timeout: float = 15.0) -> None:
    left: dict[int, str] = {}

    def gone() -> bool:
        left.clear()
        left.update(job_processes(job_id))
        return not left

    try:
        wait_until(gone, timeout, "the job's processes to end")
    except AssertionError:
        raise AssertionError(f"orphans of job {job_id}: {left}") from None


def netns_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
