"""Authenticated TCP connections between every pair of members of a communicator.

Each member listens on an ephemeral port, publishes ``host:port`` in the rendezvous store under the
communicator's scope, then connects to every lower-ranked member and accepts every higher-ranked one.
Every connection opens with the job-secret handshake (see :mod:`hora.rendezvous.auth`) followed by the
connector's rank and the scope, so a stray or stale connection is refused before it carries data.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import struct
import threading
import time

from hora.errors import AuthenticationError, RendezvousError, TransportError
from hora.rendezvous.auth import authenticate_as_client, authenticate_as_server
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.wire import recv_exact

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("!I32s")


def _scope_digest(scope: str) -> bytes:
    return hashlib.sha256(scope.encode()).digest()


def route_address(host: str, port: int) -> str:
    """The local address this host uses to reach ``host``: what peers on that network can dial."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, port or 9))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass


def connect_mesh(
    rank: int,
    members: list[int],
    store: RendezvousClient,
    scope: str,
    secret: bytes,
    listen_host: str,
    timeout: float,
    buffer_bytes: int,
) -> dict[int, socket.socket]:
    """Open one authenticated socket to every other member; keys are member indices.

    ``members`` lists global ranks; ``rank`` is this process's index in it. Raises TransportError
    naming the global ranks that never published an address within ``timeout`` seconds.
    """
    size = len(members)
    if size == 1:
        return {}
    digest = _scope_digest(scope)
    listener = socket.create_server((listen_host, 0), backlog=max(16, size))
    port = listener.getsockname()[1]
    store.set(f"{scope}/addr/{members[rank]}", f"{listen_host}:{port}".encode())

    peers: dict[int, socket.socket] = {}
    accept_error: list[BaseException] = []
    expected_higher = size - 1 - rank
    deadline = time.monotonic() + timeout

    def accept_higher() -> None:
        listener.settimeout(0.2)
        while len([p for p in peers if p > rank]) < expected_higher:
            if time.monotonic() > deadline:
                missing = [members[i] for i in range(rank + 1, size) if i not in peers]
                accept_error.append(
                    TransportError(
                        f"rank {members[rank]}: ranks {missing} never connected within {timeout:.0f} s"
                    )
                )
                return
            try:
                conn, addr = listener.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                accept_error.append(exc)
                return
            try:
                conn.settimeout(None)
                authenticate_as_server(conn, secret, timeout=10.0)
                peer_rank, peer_digest = _HELLO.unpack(recv_exact(conn, _HELLO.size))
            except (AuthenticationError, RendezvousError, OSError) as exc:
                logger.warning("rank %d refused a peer connection from %s: %s", members[rank], addr, exc)
                conn.close()
                continue
            if peer_digest != digest or not rank < peer_rank < size or peer_rank in peers:
                logger.warning(
                    "rank %d refused a connection from %s claiming member %d of another communicator",
                    members[rank], addr, peer_rank,
                )
                conn.close()
                continue
            tune_socket(conn, buffer_bytes)
            peers[peer_rank] = conn

    acceptor = threading.Thread(target=accept_higher, name="hora-mesh-accept", daemon=True)
    acceptor.start()
    try:
        keys = [f"{scope}/addr/{members[i]}" for i in range(rank)]
        missing = store.wait(keys, timeout)
        if missing:
            ranks = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
            raise TransportError(
                f"rank {members[rank]}: ranks {ranks} never checked in within {timeout:.0f} s; "
                "did they crash or start late? (raise HORA_START_TIMEOUT if they are just slow)"
            )
        for lower in range(rank):
            host, port_text = store.get(keys[lower], timeout).decode().rsplit(":", 1)
            conn = _dial(host, int(port_text), deadline, members[lower])
            conn.settimeout(None)
            authenticate_as_client(conn, secret, timeout=10.0)
            conn.sendall(_HELLO.pack(rank, digest))
            tune_socket(conn, buffer_bytes)
            peers[lower] = conn
        acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if accept_error:
            raise accept_error[0]
        if acceptor.is_alive() or len(peers) != size - 1:
            missing = [members[i] for i in range(size) if i != rank and i not in peers]
            raise TransportError(f"rank {members[rank]}: ranks {missing} never connected within {timeout:.0f} s")
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    finally:
        listener.close()
    return peers


def _dial(host: str, port: int, deadline: float, peer: int) -> socket.socket:
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.5, deadline - time.monotonic()))
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TransportError(f"cannot connect to rank {peer} at {host}:{port}: {exc}") from None
            time.sleep(0.05)
