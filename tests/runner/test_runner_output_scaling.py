"""The launcher at 16 ranks: every line arrives whole and prefixed, threads do not grow with ranks,
and a rank killed among many is named.

Real `hora run` launchers and real worker processes (plain Python scripts: the launcher's output
routing and supervision do not depend on hora in the workers).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_env import clean_env

pytestmark = pytest.mark.timeout(120)

HORA = [sys.executable, "-m", "hora"]
LINES = 200

# Says it is up, then (once every rank is up, so their writes overlap) writes a line in three
# pieces with pauses between them, many whole lines on stdout and stderr, and a last line with no
# newline before exiting.
WORKER = f"""
import os, sys, time
rank = int(os.environ["HORA_RANK"])
print("up", flush=True)
time.sleep(1.5)
for piece in (f"piece-{{rank}}-a", "-b", "-c\\n"):
    sys.stdout.write(piece)
    sys.stdout.flush()
    time.sleep(0.1)
for i in range({LINES}):
    sys.stdout.write(f"rank {{rank}} line {{i}} " + "x" * (i % 50) + "\\n")
    if i % 20 == 0:
        sys.stderr.write(f"rank {{rank}} err {{i}}\\n")
sys.stdout.write(f"tail-{{rank}}")
"""


def _threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _run_and_count_threads(np: int, tmp_path: Path) -> tuple[int, str, str, int]:
    """Run WORKER on ``np`` ranks; the launcher's thread count once all ranks are up, its output."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out_dir = tmp_path / f"out{np}"
    proc = subprocess.Popen([*HORA, "run", "-np", str(np), "--output-filename", str(out_dir),
                             sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert proc.stdout is not None
        head, up = [], set()
        for line in proc.stdout:
            head.append(line)
            if line.endswith("<stdout>:up\n"):
                up.add(line)
                if len(up) == np:
                    break
        threads = _threads_of(proc.pid)
        rest, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return threads, "".join(head) + rest, err, proc.returncode


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[int, str, str, int, Path]]:
    found = {}
    for np in (4, 16):
        tmp = tmp_path_factory.mktemp(f"np{np}")
        found[np] = (*_run_and_count_threads(np, tmp), tmp / f"out{np}")
    return found


def test_sixteen_ranks_every_line_whole_prefixed_and_in_order(runs):
    _threads, out, err, code, out_dir = runs[16]
    assert code == 0, err
    prefix = re.compile(r"^\[(\d+)\]<stdout>:(.*)$")
    by_rank: dict[int, list[str]] = {rank: [] for rank in range(16)}
    for line in out.splitlines():
        match = prefix.match(line)
        assert match, f"line without a rank prefix: {line!r}"
        by_rank[int(match.group(1))].append(match.group(2))
    for rank, lines in by_rank.items():
        expected = (["up", f"piece-{rank}-a-b-c"]
                    + [f"rank {rank} line {i} " + "x" * (i % 50) for i in range(LINES)]
                    + [f"tail-{rank}"])
        assert lines == expected, f"rank {rank}'s stdout differs"
        raw = (out_dir / f"rank.{rank:02d}" / "stdout").read_text()
        assert raw == "\n".join(expected[:-1]) + "\n" + expected[-1]  # raw bytes, no added newline
    for rank in range(16):
        errs = [line for line in err.splitlines() if line.startswith(f"[{rank}]<stderr>:")]
        assert errs == [f"[{rank}]<stderr>:rank {rank} err {i}" for i in range(0, LINES, 20)]


def test_launcher_threads_do_not_grow_with_ranks(runs):
    four, sixteen = runs[4][0], runs[16][0]
    assert runs[4][3] == 0 and runs[16][3] == 0
    # Before: 3 threads per rank (a waiter and two output readers); now one of each for all ranks.
    assert sixteen == four, f"launcher threads: {four} at 4 ranks, {sixteen} at 16 ranks"
    assert sixteen <= 6


def test_killed_rank_among_sixteen_is_named_quickly(tmp_path):
    script = tmp_path / "die.py"
    script.write_text("import os, signal, time\n"
                      "time.sleep(1.0)\n"
                      "if os.environ['HORA_RANK'] == '11':\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(60)\n")
    started = time.monotonic()
    done = subprocess.run([*HORA, "run", "-np", "16", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=60, env=clean_env())
    elapsed = time.monotonic() - started
    assert done.returncode == 128 + 9, done.stderr
    assert ("rank 11 on localhost was killed by signal SIGKILL (9); stopped the other 15 workers"
            in done.stderr)
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end after a rank was killed"


class _WithoutPid:
    """A worker the watcher cannot open a pidfd for: it is polled instead."""

    pid = None

    def __init__(self, worker) -> None:
        self._worker = worker

    def poll_exit(self):
        return self._worker.poll_exit()


def test_exit_watcher_reports_each_exit_once_with_and_without_pidfd():
    import queue
    import threading

    from hora.runner.launching.exits import ExitWatcher
    from hora.runner.launching.process import LocalWorker

    seen: queue.Queue = queue.Queue()
    watcher = ExitWatcher(lambda key, code, detail: seen.put((key, code, detail)), name="test-exits")
    workers = [LocalWorker([sys.executable, "-c", f"import sys, time; time.sleep({0.3 * i}); sys.exit({i})"],
                           clean_env()) for i in range(3)]
    watcher.watch("pidfd-0", workers[0])
    watcher.watch("polled-1", _WithoutPid(workers[1]))
    watcher.watch("pidfd-2", workers[2])
    got = sorted(seen.get(timeout=20) for _ in range(3))
    assert got == [("pidfd-0", 0, None), ("pidfd-2", 2, None), ("polled-1", 1, None)]
    deadline = time.monotonic() + 5
    while any(t.name == "test-exits" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "test-exits" for t in threading.enumerate()), "the watcher outlived its workers"
    assert seen.empty()
    for worker in workers:
        worker.proc.stdout.close()
        worker.proc.stderr.close()
