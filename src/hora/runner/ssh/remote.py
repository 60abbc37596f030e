"""One rank on a remote host: an ssh client here, the :mod:`remote_bootstrap` wrapper there.

The ssh command line carries nothing secret: ``cd CWD`` and a Python started with a one-line loader
(plus ``hora-worker job=<id> rank=<n>``, so ``ps`` on the remote host says what it is). Everything
else goes through the ssh client's stdin, inside the encrypted channel: first the wrapper's source,
then a JSON payload with the worker's argv, working directory, environment (the ``HORA_*`` identity,
rendezvous address and job secret, and the launcher's own variables as Horovod forwards them), the
``--network-interfaces`` list and the kill grace. The launcher keeps that stdin open for the life of
the rank. Closing it is how the launcher stops the rank gracefully; if this launcher dies, its ssh
clients die with it (PDEATHSIG), the channel closes, and the wrapper stops the worker the same way.
The same happens when the remote sshd session is killed, so no path leaves a worker running.

The wrapper ends by writing a status line tagged with a random per-launch token on stderr. This
module strips that line from the rank's output and turns it into the rank's exit description, so a
remote ``SIGKILL`` reads as "was killed by signal SIGKILL (9)", a worker that could not be started
says why, and an ssh client that died without that line means the connection was lost.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hora import config
from hora.runner.launching.process import group_alive, signal_group, spawn
from hora.runner.ssh.options import SshOptions
from hora.workers import remote_bootstrap

logger = logging.getLogger(__name__)

# Reads the wrapper's source from stdin and runs it; quoted once into the remote command line.
LOADER = ("import sys;b=sys.stdin.buffer;"
          "exec(compile(b.read(int(b.readline())),'hora-bootstrap','exec'))")
# After the ssh client exits, how long its stderr may take to deliver the wrapper's status line.
_STATUS_WAIT_SECONDS = 2.0

# Variables that describe the launcher's own login session or shell, not the job: the remote
# session has its own (Horovod's launcher filters the same kind).
_NOT_FORWARDED = frozenset({
    "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "MAIL", "TMUX", "TMUX_PANE", "STY",
    "WINDOW", "SSH_AUTH_SOCK", "SSH_AGENT_PID", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY",
    "XDG_RUNTIME_DIR", "XDG_SESSION_ID", "XDG_SESSION_TYPE", "XDG_SESSION_CLASS",
    "DBUS_SESSION_BUS_ADDRESS",
})
_NOT_FORWARDED_PREFIXES = ("BASH_FUNC_",)


def forwarded_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables that belong to this machine's login session."""
    return {
        key: value for key, value in env.items()
        if key not in _NOT_FORWARDED and not key.startswith(_NOT_FORWARDED_PREFIXES)
    }


@functools.lru_cache(maxsize=1)
def bootstrap_source() -> bytes:
    """The wrapper's source, as sent to every remote rank."""
    return Path(remote_bootstrap.__file__).read_bytes()


@dataclass(frozen=True)
class RemoteTarget:
    """How to start a rank on a remote host: ssh options, where, and how to stop it."""

    ssh: SshOptions
    cwd: str
    job_id: str
    interfaces: tuple[str, ...] | None = None
    kill_grace: float = 5.0
    python: str = sys.executable


def remote_command(host: str, rank: int, target: RemoteTarget) -> str:
    """The one shell string run on ``host``: change directory, start a Python with the loader.

    The launcher's own interpreter is tried first (same install on every host, as with Horovod),
    then any ``python3`` on the remote PATH: the wrapper needs nothing but the standard library.
    """
    q = shlex.quote
    pythons = " ".join(q(p) for p in dict.fromkeys([target.python, "python3"]))
    tag = f"hora-worker job={q(target.job_id)} rank={int(rank)}"
    return (
        f"cd {q(target.cwd)} || "
        f"{{ echo {q(f'hora: cannot change to directory {target.cwd} on {host}')} >&2; exit 126; }}; "
        f"for hora_py in {pythons}; do "
        f"if command -v \"$hora_py\" >/dev/null 2>&1; then exec \"$hora_py\" -I -c {q(LOADER)} {tag}; fi; "
        f"done; echo {q(f'hora: no Python interpreter ({target.python} or python3) on {host}')} >&2; exit 127"
    )


class RemoteWorker:
    """A started remote rank, as the supervisor sees it (same interface as ``LocalWorker``)."""

    def __init__(self, rank: int, host: str, argv: Sequence[str], env: Mapping[str, str],
                 target: RemoteTarget) -> None:
        self.rank = rank
        self.host = host
        self.target = target
        self._token = secrets.token_hex(16)
        payload = {
            "token": self._token,
            "host": host,
            "rank": rank,
            "argv": [str(part) for part in argv],
            "cwd": target.cwd,
            "env": dict(env),
            "interfaces": list(target.interfaces) if target.interfaces else None,
            "iface_vars": sorted(config.env_for("iface", "")),
            "kill_grace": target.kill_grace,
        }
        self._stdin_data = (remote_bootstrap.frame(bootstrap_source())
                            + remote_bootstrap.frame(json.dumps(payload).encode()))
        self._token_bytes = self._token.encode()
        self._close_stdin = threading.Event()
        self._stderr_done: threading.Event | None = None
        self._exited_at: float | None = None
        self.status: tuple[int, str | None] | None = None
        self.last_stderr_line = ""
        command = remote_command(host, rank, target)
        self.argv = target.ssh.argv(host, command)
        # The ssh client gets the launcher's own environment: the job's variables (and its secret)
        # travel on stdin only.
        self.proc = spawn(self.argv, config.environ_copy(), stdin=subprocess.PIPE)
        self.pid = self.proc.pid
        self._feeder: threading.Thread | None = None
        self._start_feed()

    @property
    def stdout(self):
        return self.proc.stdout

    @property
    def stderr(self):
        return self.proc.stderr

    def describe(self) -> str:
        return f"ssh {self.host} (pid {self.pid})"

    @property
    def _stdin(self) -> IO[bytes]:
        stdin = self.proc.stdin
        assert stdin is not None  # spawned with stdin=PIPE
        return stdin

    def _start_feed(self) -> None:
        """Send the wrapper and payload: at once when the pipe takes it all (the usual case, tens of
        KiB), else from a thread, so a 64-rank SSH job does not cost 64 writer threads."""
        fd = self._stdin.fileno()
        os.set_blocking(fd, False)
        sent = 0
        try:
            while sent < len(self._stdin_data):
                sent += os.write(fd, self._stdin_data[sent:])
        except BlockingIOError:
            pass
        except OSError as exc:  # the ssh client is already gone: its exit says why
            logger.debug("stdin of rank %d's ssh closed early: %s", self.rank, exc)
        os.set_blocking(fd, True)
        if sent < len(self._stdin_data):
            self._feeder = threading.Thread(target=self._feed, args=(sent,),
                                            name=f"hora-ssh-stdin-{self.rank}", daemon=True)
            self._feeder.start()

    def _feed(self, sent: int) -> None:
        stdin = self._stdin
        try:
            stdin.write(self._stdin_data[sent:])
            stdin.flush()
            self._close_stdin.wait()
        except (BrokenPipeError, OSError, ValueError) as exc:
            logger.debug("stdin of rank %d's ssh closed early: %s", self.rank, exc)
        finally:
            self._close_channel()

    def _close_channel(self) -> None:
        try:
            self._stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def attach_stderr_done(self, done: threading.Event | None) -> None:
        """The output router's end-of-file event for this rank's stderr (which carries the status line)."""
        self._stderr_done = done

    def filter_stderr(self, chunk: bytes) -> bytes:
        """Take the wrapper's status line out of the rank's stderr; remember the last line."""
        at = chunk.find(self._token_bytes)
        if at < 0:
            text = chunk.decode("utf-8", errors="replace").strip()
            if text:
                self.last_stderr_line = text
            return chunk
        try:
            code, message = json.loads(chunk[at + len(self._token_bytes):].decode())
            self.status = (int(code), message if isinstance(message, str) else None)
        except (ValueError, TypeError):
            return chunk  # not ours after all: show it
        return chunk[:at]

    def wait(self) -> tuple[int, str | None]:
        """Block until the ssh client exits; the rank's return code and, if needed, what happened."""
        returncode = self.proc.wait()
        if self._stderr_done is not None:
            self._stderr_done.wait(_STATUS_WAIT_SECONDS)
        return self._outcome(returncode)

    def poll_exit(self) -> tuple[int, str | None] | None:
        """:meth:`wait` without blocking: None while the ssh client runs, or while its stderr may
        still bring the wrapper's status line (up to a bounded wait after the client exited)."""
        returncode = self.proc.poll()
        if returncode is None:
            return None
        if self._exited_at is None:
            self._exited_at = time.monotonic()
        if (self._stderr_done is not None and not self._stderr_done.is_set()
                and time.monotonic() - self._exited_at < _STATUS_WAIT_SECONDS):
            return None
        return self._outcome(returncode)

    def _outcome(self, returncode: int) -> tuple[int, str | None]:
        if self.status is not None:
            return self.status
        if returncode == 255:
            last = f": {self.last_stderr_line}" if self.last_stderr_line else ""
            return 255, f"lost its SSH connection (ssh exited with status 255{last})"
        return returncode, None

    def terminate(self) -> None:
        """Close the channel's stdin: the wrapper stops the worker (SIGTERM, SIGKILL after the grace)."""
        self._close_stdin.set()
        if self._feeder is None:
            self._close_channel()

    def kill(self) -> None:
        """Kill the ssh client: the connection drops and the wrapper stops the worker."""
        signal_group(self.pid, signal.SIGKILL)

    def alive(self) -> bool:
        return group_alive(self.pid)
