"""Is a host name this machine?

Until SSH launch exists, ``hora run`` starts every worker as a local child process, so a host list
naming another machine must be refused up front rather than silently running those ranks here.
No name is resolved through DNS: a remote-looking name is never slow to reject, and a name only
counts as local when it is literally one of this machine's names or addresses.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket

from hora.errors import LaunchError
from hora.runner.hosts import Host

logger = logging.getLogger(__name__)

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


@functools.lru_cache(maxsize=None)
def _own_names() -> frozenset[str]:
    names = set(_LOCAL_NAMES)
    hostname = socket.gethostname()
    names.add(hostname.lower())
    names.add(hostname.split(".", 1)[0].lower())
    try:
        names.add(socket.getfqdn().lower())
    except OSError:  # pragma: no cover - getfqdn swallows its own errors on CPython
        pass
    return frozenset(names)


def _is_own_address(text: str) -> bool:
    """Whether ``text`` is an IP literal of this machine: loopback, or bindable here."""
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((text, 0))  # only addresses of this machine's interfaces can be bound
        return True
    except OSError:
        return False


def is_local_host(name: str) -> bool:
    """True when ``name`` is localhost, a loopback address, this machine's name or one of its addresses."""
    lowered = name.lower()
    if lowered in _LOCAL_NAMES:
        return True
    if _is_own_address(name):
        return True
    return lowered in _own_names()


def require_local_hosts(hosts: list[Host]) -> None:
    """Refuse a layout that needs another machine; multi-host launch over SSH comes later."""
    remote = [host.name for host in hosts if not is_local_host(host.name)]
    if remote:
        raise LaunchError(
            f"host {remote[0]!r} is not this machine, and multi-host launch over SSH is not "
            f"supported yet (remote hosts: {', '.join(remote)}); run all ranks on this host, "
            "e.g. -H localhost:N"
        )
