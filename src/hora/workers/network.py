"""Addresses for a multi-host job: where the launcher's store listens, what local workers use.

A job on one machine keeps everything on loopback. Once a host is remote, the rendezvous store must
listen on an address every host can reach: the ``--network-interfaces`` entry that exists on this
machine (an interface name, resolved to its IPv4 address, or one of its addresses), else the
address this machine's routing table uses toward the first remote host. No packet is sent to find
it (a UDP socket is connected, never written).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence

from hora.errors import LaunchError
from hora.workers.remote_bootstrap import resolve_listen_address

logger = logging.getLogger(__name__)


def route_source_address(host: str) -> str | None:
    """The local address this machine would use to reach ``host``, or None when there is no route."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(sockaddr)
            except OSError:
                continue
            return str(probe.getsockname()[0])
    return None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def launcher_address(remote_hosts: Sequence[str], interfaces: Sequence[str] | None = None) -> str:
    """The address the job's rendezvous store listens on and workers on every host dial.

    Raises LaunchError when no address of this machine can be found that the remote hosts reach.
    """
    if interfaces:
        try:
            address = resolve_listen_address(interfaces)
        except LookupError as exc:
            logger.info("--network-interfaces does not name this machine's interfaces (%s); "
                        "using the route toward %s", exc, remote_hosts[0])
        else:
            logger.info("rendezvous store on %s (from --network-interfaces)", address)
            return address
    for host in remote_hosts:
        routed = route_source_address(host)
        if routed and not _is_loopback(routed):
            logger.info("rendezvous store on %s (the route toward %s)", routed, host)
            return routed
    raise LaunchError(
        f"cannot find an address of this machine that {', '.join(remote_hosts)} can reach (no route); "
        "give --network-interfaces with an interface or address of this machine"
    )
