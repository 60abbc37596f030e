"""Host lists and the rank layout derived from them.

``hora run`` accepts hosts as ``-H host1:2,host2:2`` or as a hostfile (``host slots=N`` lines), like
``horovodrun``. This module turns either form into a list of :class:`Host` and then packs ranks onto
them host by host, computing every worker's local and cross coordinates. It is pure computation (no
processes, no network) so layouts for many hosts can be checked without launching anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hora.errors import ConfigError

# Host names and IPv4 addresses; IPv6 literals are handled separately.
_NAME_RE = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_IPV6_RE = re.compile(r"^[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?$")


@dataclass(frozen=True)
class Host:
    """A machine and how many workers (slots) it may run."""

    name: str
    slots: int

    def __str__(self) -> str:
        name = f"[{self.name}]" if ":" in self.name else self.name
        return f"{name}:{self.slots}"


@dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its coordinates in the job (what the worker's environment says)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str


def _check_name(name: str, where: str) -> str:
    if _NAME_RE.match(name) or (":" in name and _IPV6_RE.match(name)):
        return name
    raise ConfigError(f"{where}: {name!r} is not a valid host name")


def _parse_slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"{where}: slots must be a positive integer, got {text!r}") from None
    if slots < 1:
        raise ConfigError(f"{where}: slots must be a positive integer, got {text!r}")
    return slots


def parse_host_entry(entry: str, where: str = "host") -> Host:
    """One ``host``, ``host:N``, ``[ipv6]:N`` or bare IPv6 entry; slots default to 1."""
    entry = entry.strip()
    if not entry:
        raise ConfigError(f"{where}: empty host entry")
    if entry.startswith("["):
        close = entry.find("]")
        if close < 0:
            raise ConfigError(f"{where}: {entry!r} has '[' without a closing ']'")
        name, rest = entry[1:close], entry[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{where}: unexpected {rest!r} after {entry[: close + 1]!r}")
        slots = _parse_slots(rest[1:], where) if rest else 1
        if ":" not in name:
            raise ConfigError(f"{where}: brackets are only for IPv6 addresses, got {entry!r}")
        return Host(_check_name(name, where), slots)
    if entry.count(":") > 1:  # a bare IPv6 address: no room for a slot count
        return Host(_check_name(entry, where), 1)
    name, sep, slots_text = entry.partition(":")
    slots = _parse_slots(slots_text, where) if sep else 1
    return Host(_check_name(name, where), slots)


def _reject_duplicates(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise ConfigError(f"{where}: host {host.name!r} is listed more than once; "
                              "give it once with the total number of slots")
        seen.add(host.name)
    return hosts


def parse_hosts(text: str) -> list[Host]:
    """Parse ``-H`` syntax: comma-separated ``host[:slots]`` entries."""
    if not text or not text.strip():
        raise ConfigError("-H/--hosts: empty host list")
    hosts = [
        parse_host_entry(entry, where=f"-H/--hosts entry {index}")
        for index, entry in enumerate(text.split(","), start=1)
    ]
    return _reject_duplicates(hosts, "-H/--hosts")


def parse_hostfile_text(text: str, filename: str = "<hostfile>") -> list[Host]:
    """Parse hostfile contents: ``host slots=N``, ``host:N`` or ``host`` per line, ``#`` comments."""
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{filename}:{lineno}"
        fields = line.split()
        host = parse_host_entry(fields[0], where)
        if len(fields) > 1:
            if ":" in fields[0] and not fields[0].startswith("[") and fields[0].count(":") == 1:
                raise ConfigError(f"{where}: give the slots either as host:N or as slots=N, not both")
            if len(fields) > 2:
                raise ConfigError(f"{where}: expected 'host slots=N', got {line!r}")
            key, eq, value = fields[1].partition("=")
            if key != "slots" or not eq:
                raise ConfigError(f"{where}: expected 'slots=N' after the host name, got {fields[1]!r}")
            host = Host(host.name, _parse_slots(value, where))
        hosts.append(host)
    if not hosts:
        raise ConfigError(f"{filename}: the hostfile lists no hosts")
    return _reject_duplicates(hosts, filename)


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read and parse a hostfile; errors name the file (and the line, for bad lines)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read hostfile {str(path)!r}: {exc.strerror or exc}") from None
    return parse_hostfile_text(text, filename=str(path))


def default_hosts(np: int) -> list[Host]:
    """What a job without ``-H``/``--hostfile`` runs on: ``localhost:np``."""
    return [Host("localhost", np)]


def total_slots(hosts: list[Host]) -> int:
    return sum(host.slots for host in hosts)


def hosts_used(hosts: list[Host], np: int) -> list[Host]:
    """The prefix of ``hosts`` that ranks are packed onto, each with the slots actually used."""
    if np < 1:
        raise ConfigError(f"the number of processes must be at least 1, got {np}")
    available = total_slots(hosts)
    if np > available:
        raise ConfigError(
            f"-np {np} is larger than the {available} slots available on "
            f"{', '.join(str(host) for host in hosts)}"
        )
    used: list[Host] = []
    remaining = np
    for host in hosts:
        if remaining == 0:
            break
        take = min(host.slots, remaining)
        used.append(Host(host.name, take))
        remaining -= take
    return used


def assign_slots(hosts: list[Host], np: int) -> list[SlotInfo]:
    """Pack ``np`` ranks onto ``hosts`` host by host and compute each rank's coordinates.

    local_rank is a rank's index among the ranks on its host and local_size their number;
    cross_size is the number of hosts that have a rank with that local_rank, and cross_rank the
    index of this host among them (in host-list order).
    """
    used = hosts_used(hosts, np)
    slots: list[SlotInfo] = []
    rank = 0
    for host in used:
        for local_rank in range(host.slots):
            peers = [other for other in used if other.slots > local_rank]
            cross_rank = next(i for i, other in enumerate(peers) if other.name == host.name)
            slots.append(
                SlotInfo(
                    rank=rank,
                    size=np,
                    local_rank=local_rank,
                    local_size=host.slots,
                    cross_rank=cross_rank,
                    cross_size=len(peers),
                    hostname=host.name,
                )
            )
            rank += 1
    return slots
