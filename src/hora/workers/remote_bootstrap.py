"""The remote end of one SSH-launched worker: a small, stdlib-only supervisor for one rank.

The launcher never puts this file, the worker's environment or the job secret on a command line.
The SSH command line only says ``cd CWD`` and starts a Python with a one-line loader (see
:mod:`hora.runner.ssh.remote`); the loader reads this module's source from its stdin (the SSH channel)
and runs it, and this code then reads the job payload from the same stdin: a length-prefixed JSON
object with the worker's argv, working directory, environment (which carries the secret), the
``--network-interfaces`` list, the kill grace and a per-launch status token. So the secret travels
only inside the encrypted SSH channel and lands only in the worker's environment.

Then it:

1. resolves ``--network-interfaces`` on *this* host (an interface name becomes its IPv4 address, an
   address literal counts when it belongs to this host) and passes it to the worker as
   ``HORA_IFACE``, the address the transport listens on;
2. becomes a child subreaper and starts the worker in its own session, with ``PDEATHSIG=SIGKILL``
   so the worker dies if this wrapper is killed outright;
3. watches its stdin: end of file means the launcher closed it (stopping the rank), the local ssh
   client died, the connection dropped, or this session's sshd was killed. Any of those, or
   SIGTERM/SIGHUP/SIGINT, stops the worker's process group: SIGTERM, then SIGKILL after the grace;
4. when the worker ends (or was stopped), stops whatever is left of its group and any descendant
   that was reparented here, writes one status line ``<token> [returncode, message]`` on stderr
   (so the launcher can tell "killed by SIGKILL" from "exited 137" and from a lost connection) and
   exits with the worker's status (128+N for signal N, as shells report it).

It must run on whatever Python 3 the remote host has, so it imports nothing from hora and reads
``os.environ`` directly (the remote login environment is the base the job's variables are laid
over). The launcher imports it too, for :func:`resolve_listen_address` and :func:`can_bind`.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

_SIOCGIFADDR = 0x8915
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_POLL_SECONDS = 0.02
_AFTER_KILL_SECONDS = 5.0
MAX_FRAME_BYTES = 64 * 1024 * 1024


# ---- network interfaces (used here on each host, and by the launcher for its own host) ---------

def interface_names() -> list:
    """Names of this host's network interfaces (empty when they cannot be listed)."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def interface_ipv4(name: str):
    """The IPv4 address of interface ``name`` on this host, or None (no such interface, no IPv4)."""
    raw = name.encode()
    if not raw or len(raw) > 15 or b"\0" in raw:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", raw))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def can_bind(address: str) -> bool:
    """Whether ``address`` (an IP literal) belongs to this host: only own addresses can be bound."""
    try:
        version = ipaddress.ip_address(address.split("%", 1)[0]).version
    except ValueError:
        return False
    family = socket.AF_INET6 if version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def resolve_listen_address(names) -> str:
    """The first of ``names`` that means something on this host, as an address to listen on.

    An interface name counts when it exists here with an IPv4 address; an address literal counts
    when it is one of this host's addresses (so ``10.0.0.1,10.0.0.2`` works across two hosts).
    Raises LookupError naming what was tried and the interfaces this host has.
    """
    for name in names:
        try:
            ipaddress.ip_address(name.split("%", 1)[0])
        except ValueError:
            address = interface_ipv4(name)
            if address is not None:
                return address
            continue
        if can_bind(name):
            return name
    available = ", ".join(interface_names()) or "none found"
    raise LookupError(
        f"none of {', '.join(repr(n) for n in names)} is a network interface with an IPv4 address "
        f"or an address of this host (its interfaces: {available})"
    )


# ---- the wrapper ----------------------------------------------------------------------------------

def read_frame(stream) -> bytes:
    """One ``<decimal length>\\n<bytes>`` frame from a binary stream; EOFError if cut short."""
    header = stream.readline(32)
    if not header.endswith(b"\n"):
        raise EOFError("the launch payload ended before its length line")
    length = int(header)
    if not 0 <= length <= MAX_FRAME_BYTES:
        raise ValueError(f"bad payload length {length}")
    data = stream.read(length)
    if len(data) != length:
        raise EOFError(f"the launch payload ended after {len(data)} of {length} bytes")
    return data


def frame(data: bytes) -> bytes:
    return str(len(data)).encode() + b"\n" + data


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


def _exit_code(status: int) -> int:
    """A waitpid status as Popen reports it: the exit status, or -N when killed by signal N."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 1


def _children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (descendants reparented to this subreaper)."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] not in (b"Z", b"X"):
            found.append(int(name))
    return found


class Wrapper:
    """Runs one worker for the launcher at the other end of stdin (see the module docstring)."""

    def __init__(self, payload: dict, stdin_fd: int) -> None:
        self.payload = payload
        self.stdin_fd = stdin_fd
        self.token = str(payload["token"])
        self.grace = float(payload.get("kill_grace", 5.0))
        self.stdin_closed = threading.Event()
        self.signalled = None  # set from a signal handler: a plain attribute, no locks
        self.worker_pid: int | None = None
        self.worker_code: int | None = None
        self.prctl = _prctl()

    # -- reporting --
    def report(self, code: int, message=None) -> int:
        line = f"{self.token} {json.dumps([code, message])}\n"
        try:
            sys.stderr.flush()
            os.write(2, line.encode())
        except OSError:
            pass  # the channel is gone: nobody is left to tell
        if code < 0:
            return min(128 - code, 255)
        return min(code, 255)

    # -- stop requests --
    def _watch_stdin(self) -> None:
        # Raw reads of the descriptor: the payload has been consumed, nothing else is ever sent,
        # and a thread blocked in a buffered reader would trip the interpreter's exit.
        try:
            while os.read(self.stdin_fd, 65536):
                pass
        except OSError:
            pass
        self.stdin_closed.set()

    def _on_signal(self, signum, frame) -> None:
        self.signalled = signum

    def stop_requested(self) -> bool:
        return self.stdin_closed.is_set() or self.signalled is not None

    # -- children --
    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.worker_pid and self.worker_code is None:
                self.worker_code = _exit_code(status)

    def _group_alive(self) -> bool:
        self._reap()
        assert self.worker_pid is not None  # asked only once the worker has started
        try:
            os.killpg(self.worker_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _signal_all(self, signum: int) -> None:
        assert self.worker_pid is not None  # sent only once the worker has started
        try:
            os.killpg(self.worker_pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in _children_of(os.getpid()):  # escaped their group (setsid) but still ours
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _anything_alive(self) -> bool:
        return self._group_alive() or bool(_children_of(os.getpid()))

    def _stop_everything(self) -> None:
        """SIGTERM the worker's group and reparented descendants; SIGKILL what survives the grace."""
        if not self._anything_alive():
            return
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and self._anything_alive():
            time.sleep(_POLL_SECONDS)
        if self._anything_alive():
            self._signal_all(signal.SIGKILL)
            deadline = time.monotonic() + _AFTER_KILL_SECONDS
            while time.monotonic() < deadline and self._anything_alive():
                time.sleep(_POLL_SECONDS)

    def _preexec(self):
        prctl, parent = self.prctl, os.getpid()

        def setup() -> None:
            if prctl is not None:
                prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

        return setup

    def environment(self) -> dict:
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in self.payload.get("env", {}).items()})
        cwd = self.payload.get("cwd")
        if cwd:
            env["PWD"] = cwd
        interfaces = self.payload.get("interfaces")
        if interfaces:
            address = resolve_listen_address(interfaces)
            for name in self.payload.get("iface_vars", ["HORA_IFACE"]):
                env[name] = address
        return env

    def run(self) -> int:
        threading.Thread(target=self._watch_stdin, name="hora-stdin", daemon=True).start()
        for name in ("SIGTERM", "SIGHUP", "SIGINT"):
            signal.signal(getattr(signal, name), self._on_signal)
        if self.prctl is not None:
            self.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        try:
            env = self.environment()
        except LookupError as exc:
            return self.report(2, f"cannot use --network-interfaces: {exc}")
        argv = [str(part) for part in self.payload["argv"]]
        try:
            proc = subprocess.Popen(
                argv, env=env, cwd=self.payload.get("cwd") or None, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=self._preexec(), close_fds=True,
            )
        except OSError as exc:
            return self.report(127, f"could not be started: {exc.strerror or exc}: {argv[0]!r}")
        self.worker_pid = proc.pid
        while self.worker_code is None and not self.stop_requested():
            self._reap()
            if self.worker_code is None:
                time.sleep(_POLL_SECONDS)
        self._stop_everything()
        self._reap()
        proc.returncode = self.worker_code if self.worker_code is not None else -int(signal.SIGKILL)
        return self.report(proc.returncode)


def main() -> int:
    stdin = sys.stdin.buffer
    try:
        payload = json.loads(read_frame(stdin))
    except (ValueError, EOFError) as exc:
        sys.stderr.write(f"hora: no valid launch payload arrived on stdin ({exc})\n")
        return 2
    return Wrapper(payload, stdin.fileno()).run()


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # the stdin watcher may still be blocked in read(): nothing else to clean up
