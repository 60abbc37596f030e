"""Starting worker processes so they can always be stopped, together with everything they started.

Each worker runs in its own session (so its process group id is its pid, and a terminal's Ctrl-C
reaches only the launcher, which then stops workers in order). Signals go to the whole group, so a
worker's own children (a shell's ``python``, a data loader's subprocesses) die with it. On Linux the
child also asks the kernel for ``PR_SET_PDEATHSIG=SIGKILL``: if the launcher is killed outright
(SIGKILL, OOM killer) its workers die too instead of running on as orphans.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _resolve_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent so the forked child does no symbol lookup."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


_PRCTL = _resolve_prctl()
_SIGKILL = int(signal.SIGKILL)


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL this child when the thread that forked it dies.

    The check of ``getppid`` closes the race where the launcher died between fork and prctl.
    PDEATHSIG fires when the forking *thread* exits, so callers spawn from a thread that outlives
    the workers (the launcher's main thread, or the thread running :func:`hora.run`).
    """

    def setup() -> None:
        if _PRCTL is None:
            return
        _PRCTL(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return setup


def spawn(argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None,
          stdin: int = subprocess.DEVNULL) -> subprocess.Popen:
    """Start one process in a new session with piped stdout/stderr (and, by default, no stdin)."""
    return subprocess.Popen(
        list(argv),
        env=dict(env),
        cwd=cwd,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid()),
        close_fds=True,
    )


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to process group ``pgid``; False when the group no longer exists."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        logger.warning("cannot signal process group %d: %s", pgid, exc)
        return False


def _proc_group_has_live_member(pgid: int) -> bool:
    """Scan /proc for a non-zombie process in ``pgid`` (zombies cannot be killed, only reaped)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a live (non-zombie) member."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if os.path.isdir("/proc"):
        return _proc_group_has_live_member(pgid)
    return True


class LocalWorker:
    """A worker started on this machine, leading its own process group.

    The supervisor drives local and remote workers (:class:`hora.runner.ssh.remote.RemoteWorker`)
    through the same few methods: ``wait``, ``poll_exit``, ``terminate``, ``kill``, ``alive``.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.proc = spawn(argv, env)
        self.pid = self.proc.pid  # also the process group id

    @property
    def stdout(self):
        return self.proc.stdout

    @property
    def stderr(self):
        return self.proc.stderr

    def describe(self) -> str:
        return f"pid {self.pid}"

    def wait(self) -> tuple[int, str | None]:
        """Block until the worker exits: its Popen return code (and no further explanation)."""
        return self.proc.wait(), None

    def poll_exit(self) -> tuple[int, str | None] | None:
        """:meth:`wait` without blocking: None while the worker runs."""
        returncode = self.proc.poll()
        return None if returncode is None else (returncode, None)

    def terminate(self) -> None:
        signal_group(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        signal_group(self.pid, signal.SIGKILL)

    def alive(self) -> bool:
        """Whether the worker or anything left in its group still runs."""
        return group_alive(self.pid)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_returncode(returncode: int) -> str:
    """Human wording of a Popen return code: ``exited with status 3`` or ``was killed by signal SIGKILL (9)``."""
    if returncode < 0:
        return f"was killed by signal {signal_name(-returncode)} ({-returncode})"
    return f"exited with status {returncode}"


def exit_status_for(returncode: int) -> int:
    """The launcher's exit status for a worker's return code: the status itself, or 128+signum."""
    if returncode < 0:
        return min(128 + (-returncode), 255)
    if returncode == 0:
        return 0
    return returncode if returncode <= 255 else 1
