"""Where an elastic job finds its hosts: a fixed list, a discovery script, or a Python function.

The elastic driver asks its :class:`HostDiscovery` for the hosts about once a second. What comes back
is an ordered ``{host: slots}``; a source that fails (a script that exits non-zero, prints a line that
is not ``host`` or ``host:slots``, or runs past its time-out) raises :class:`DiscoveryError` and the
driver keeps the hosts it last knew: one bad answer must never shrink, let alone kill, a running job.

A discovery script (Horovod's ``--host-discovery-script``) prints one host per line, ``host:slots``,
or ``host`` alone (``--slots-per-host`` slots, 1 without it). Blank lines and ``#`` comments are
skipped. Any other line makes the whole answer invalid rather than partly read, because a half-read
answer would look like hosts were removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from hora.errors import ConfigError, HoraError
from hora.workers.hosts import Host, parse_host_entry

# Hosts in the order the source gave them, with their slots.
HostSlots = dict[str, int]


class DiscoveryError(HoraError):
    """One attempt to discover hosts failed; the next poll tries again."""


class HostDiscovery(Protocol):
    """A source of the job's current hosts."""

    def find(self) -> HostSlots:
        """The hosts available now, in a stable order; raises :class:`DiscoveryError` on failure."""
        ...

    @property
    def static(self) -> bool:
        """Whether the answer can never change (a fixed host list): the driver then knows that a host
        it blacklisted for good is never coming back."""
        ...


class FixedHosts:
    """The hosts of ``-H``/``--hostfile``: elastic only in surviving failures, never in growing."""

    static = True

    def __init__(self, hosts: Iterable[Host]) -> None:
        self._hosts: HostSlots = {}
        for host in hosts:
            self._hosts[host.name] = self._hosts.get(host.name, 0) + host.slots

    def find(self) -> HostSlots:
        return dict(self._hosts)


def parse_discovery_output(text: str, slots_per_host: int | None) -> HostSlots:
    """Read a discovery script's output; :class:`DiscoveryError` names the first bad line."""
    hosts: HostSlots = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"line {number} ({raw.strip()[:80]!r})"
        try:
            name, slots = _split_host_line(line, slots_per_host, where)
        except ConfigError as exc:
            raise DiscoveryError(str(exc)) from None
        if name in hosts:
            raise DiscoveryError(f"{where}: host {name!r} is listed twice")
        hosts[name] = slots
    return hosts


def _split_host_line(line: str, slots_per_host: int | None, where: str) -> tuple[str, int]:
    """``host``, ``host:slots`` or ``[ipv6]:slots``; a host without slots gets ``--slots-per-host``
    (1 when that is not given, as for ``-H``)."""
    if any(ch.isspace() for ch in line):
        raise ConfigError(f"{where}: expected host or host:slots, one per line")
    host = parse_host_entry(line, where)
    explicit = "]:" in line or line.count(":") == 1
    if not explicit and slots_per_host is not None:
        return host.name, slots_per_host
    return host.name, host.slots


class ScriptDiscovery:
    """Runs a host discovery script (through the shell, so it may carry arguments) for every poll.

    The script runs in its own process group, and the whole group is killed when it outlives
    ``timeout`` seconds: a discovery command that hangs costs one poll, not the job.
    """

    static = False

    def __init__(self, script: str, slots_per_host: int | None = None, timeout: float = 10.0) -> None:
        if not script.strip():
            raise ConfigError("--host-discovery-script: empty command")
        self.script = script
        self.slots_per_host = slots_per_host
        self.timeout = timeout
        self._running: subprocess.Popen | None = None
        self._closed = False

    def find(self) -> HostSlots:
        if self._closed:
            raise DiscoveryError("discovery was closed: the job is over")
        # Output goes to files, not pipes: the answer is complete when the script exits, even if it
        # left a child holding its output open (which is then stopped with the rest of its group).
        with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
            try:
                proc = subprocess.Popen(self.script, shell=True, stdout=out_file, stderr=err_file,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                raise DiscoveryError(f"cannot run {self.script!r}: {exc}") from None
            self._running = proc
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()
                raise DiscoveryError(f"{self.script!r} did not finish within {self.timeout:g} s; "
                                     "killed it") from None
            finally:
                self._running = None
            _kill_group(proc.pid)  # whatever it left running in the background
            out_file.seek(0)
            err_file.seek(0)
            out, err = out_file.read(), err_file.read()
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no error output"]
            raise DiscoveryError(f"{self.script!r} exited with status {proc.returncode}: {tail[0][:200]}")
        return parse_discovery_output(out.decode(errors="replace"), self.slots_per_host)


    def close(self) -> None:
        """Stop polling: kill a script still running (its whole process group)."""
        self._closed = True
        running = self._running
        if running is not None and running.poll() is None:
            _kill_group(running.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


DiscoveryFunction = Callable[[], Mapping[str, int] | Iterable[str]]


class FunctionDiscovery:
    """Discovery by a Python function (for :func:`hora.run`): it returns ``{host: slots}`` or
    ``host:slots`` strings, and anything it raises counts as one failed poll."""

    static = False

    def __init__(self, func: DiscoveryFunction, slots_per_host: int | None = None) -> None:
        self.func = func
        self.slots_per_host = slots_per_host

    def find(self) -> HostSlots:
        try:
            answer = self.func()
        except Exception as exc:  # a failing callback is one failed poll
            raise DiscoveryError(f"the discovery function raised {type(exc).__name__}: {exc}") from None
        if isinstance(answer, Mapping):
            lines = [f"{host}:{slots}" for host, slots in answer.items()]
        elif isinstance(answer, (str, bytes)):
            raise DiscoveryError("the discovery function must return {host: slots} or a list of "
                                 f"'host:slots' strings, not one {type(answer).__name__}")
        else:
            try:
                lines = [str(item) for item in answer]
            except TypeError:
                raise DiscoveryError("the discovery function must return {host: slots} or a list of "
                                     f"'host:slots' strings, got {type(answer).__name__}") from None
        return parse_discovery_output("\n".join(lines), self.slots_per_host)
