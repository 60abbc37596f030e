"""Is a host name this machine?

``hora run`` starts ranks on this machine as child processes and ranks on any other host over SSH,
so it must tell the two apart. No name is resolved through DNS: a remote-looking name is never slow
to classify, and a name only counts as local when it is literally one of this machine's names or
addresses (in an emulated cluster, each network namespace is its own machine in this sense).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket

from hora.workers.remote_bootstrap import can_bind

logger = logging.getLogger(__name__)

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


@functools.cache
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
        if ipaddress.ip_address(text.split("%", 1)[0]).is_loopback:
            return True
    except ValueError:
        return False
    return can_bind(text)


def is_local_host(name: str) -> bool:
    """True when ``name`` is localhost, a loopback address, this machine's name or one of its addresses."""
    lowered = name.lower()
    if lowered in _LOCAL_NAMES:
        return True
    if _is_own_address(name):
        return True
    return lowered in _own_names()
