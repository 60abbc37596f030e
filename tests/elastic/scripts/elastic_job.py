"""Running `hora run` elastic jobs from the launcher tests: a job in the background whose output the
test reads line by line as it comes, to change the hosts when the workers reached some point (never
after a fixed sleep), with every wait bounded.

The tests put this folder on ``sys.path`` and import this module by name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from job_env import clean_env

SCRIPTS = Path(__file__).resolve().parent
HORA = [sys.executable, "-m", "hora"]
# A collective stuck because ranks diverged fails after this long rather than hanging the job.
WORKER_ENV = {"HORA_STALL_SHUTDOWN_TIME_SECONDS": "45", "HORA_STALL_CHECK_TIME_SECONDS": "20"}

_LOG_LINE = re.compile(r"LOG (\{.*\})\s*$")


def parse_logs(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The workers' ``LOG {json}`` records among output ``lines`` (prefixed by the launcher), in order."""
    return [json.loads(found.group(1)) for found in map(_LOG_LINE.search, lines) if found is not None]


def hora_run(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m hora run ARGS`` to its end (text output)."""
    return subprocess.run([*HORA, "run", *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env({**WORKER_ENV, **(env or {})}))


def assert_rank_0_blacklisted(stderr: str, fault: str, failed_pid: int, context: str = "",
                              host: str = "localhost", worker: int = 0) -> None:
    """The launcher named the failed rank 0, its host and the cause, and blacklisted that host
    (by default localhost, where the fault tests' first worker runs; ``fault`` is "raise" or "kill")."""
    cause = "exited with status 1" if fault == "raise" else r"was killed by signal SIGKILL \(9\)"
    launcher = [line for line in stderr.splitlines() if line.startswith("hora run:")]
    name = re.escape(host)
    pattern = rf"rank 0 on {name} \(worker {worker}, pid {failed_pid}\) {cause}; blacklisting {name}"
    assert any(re.search(pattern, line) for line in launcher), context
    if fault == "raise":
        assert "RuntimeError: injected failure" in stderr, context


def discovery_command(folder: Path) -> str:
    """The --host-discovery-script value for ``discover.sh`` steered by files in ``folder``."""
    return f"sh {SCRIPTS / 'discover.sh'} {folder}"


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path``'s content in one step, so the discovery script never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


class ElasticJob:
    """``python -m hora run ARGS`` in the background, its stdout and stderr collected as they come.

    Use as a context manager: on leaving, a launcher still running gets SIGTERM (it stops its
    workers), then SIGKILL, and any worker whose pid a LOG line named and which is still alive is
    killed too, so a failed test leaves nothing running.
    """

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.started = time.monotonic()
        self.proc = subprocess.Popen([*HORA, "run", *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                     env=clean_env({**WORKER_ENV, **(env or {})}))
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.ended: float | None = None
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
                         for pipe, lines in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe, lines: list[str]) -> None:
        for line in pipe:
            with self._changed:
                lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    # ---- reading ---------------------------------------------------------------------------------

    def logs(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """The workers' LOG records so far (all, or those of ``event`` whose fields equal ``match``)."""
        with self._changed:
            lines = list(self.stdout)
        return [record for record in parse_logs(lines)
                if (event is None or record["event"] == event) and all(record.get(k) == v for k, v in match.items())]

    def launcher_lines(self) -> list[str]:
        """The launcher's own stderr lines (``hora run: ...``), not the workers' forwarded output."""
        with self._changed:
            return [line for line in self.stderr if line.startswith("hora run:")]

    def output(self, tail: int = 60) -> str:
        with self._changed:
            out, err = self.stdout[-tail:], self.stderr[-tail:]
        return "--- stdout (tail)\n" + "\n".join(out) + "\n--- stderr (tail)\n" + "\n".join(err)

    def wait_for(self, condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
        """Wait until ``condition()`` is truthy (re-checked on every new line); returns its value.

        Fails naming ``what`` and showing the output if ``timeout`` passes or the launcher exits first.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                value = condition()
                if value:
                    return value
                if self.proc.poll() is not None and not any(r.is_alive() for r in self._readers):
                    raise AssertionError(f"the job ended (status {self.proc.returncode}) before {what}\n"
                                         + self.output())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {what} within {timeout:g} s\n" + self.output())
                self._changed.wait(min(left, 0.5))

    def wait_for_logs(self, count: int, event: str, what: str, timeout: float = 30.0,
                      **match: Any) -> list[dict[str, Any]]:
        """Wait for at least ``count`` LOG records of ``event`` matching ``match``; returns them all."""
        return self.wait_for(lambda: (lambda found: found if len(found) >= count else None)(
            self.logs(event, **match)), what, timeout)

    def wait_for_launcher_line(self, pattern: str, timeout: float = 30.0) -> str:
        """Wait for a launcher line matching the regular expression ``pattern``; returns it."""
        regex = re.compile(pattern)
        return self.wait_for(lambda: next((line for line in self.launcher_lines() if regex.search(line)), None),
                             f"launcher line matching {pattern!r}", timeout)

    # ---- the end ---------------------------------------------------------------------------------

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for the launcher to exit (at most ``timeout``) and its output to be read; its status."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout:g} s\n" + self.output()) from None
        for reader in self._readers:
            reader.join(timeout=10)
        self.ended = time.monotonic()
        return self.proc.returncode

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in {record["pid"] for record in self.logs()}:
            if pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)  # each worker leads its own process group
                except (ProcessLookupError, PermissionError):
                    pass
        for reader in self._readers:
            reader.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
