"""Authenticated stream connections between every pair of members of a communicator.

Each member listens on an ephemeral TCP port (and, for peers on the same host, on an abstract
Unix-domain socket, which moves bytes about twice as fast as loopback TCP), publishes its addresses
in the rendezvous store under the communicator's scope, then connects to every lower-ranked member
and accepts every higher-ranked one. Every connection opens with the job-secret handshake (see
:mod:`hora.rendezvous.auth`) followed by the connector's rank and the scope, so a stray or stale
connection is refused before it carries data. Handshakes run on their own threads: a stranger who
connects and stays silent delays nobody.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import selectors
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
HANDSHAKE_TIMEOUT = 10.0


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


def local_machine_id() -> str:
    """Identifies "this kernel and network namespace": peers with the same id can use Unix sockets.

    Abstract Unix sockets are per network namespace, so emulated hosts in separate namespaces of one
    machine correctly get different ids.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        return f"{boot}:{netns}"
    except OSError:
        return ""


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass


class _Listeners:
    """The TCP listener, plus an abstract Unix listener when same-host peers may use one."""

    def __init__(self, listen_host: str, unix: bool, backlog: int) -> None:
        self.tcp = socket.create_server((listen_host, 0), backlog=backlog)
        self.unix: socket.socket | None = None
        self.unix_name = ""
        self.machine = local_machine_id() if unix else ""
        if self.machine:
            name = f"hora-{secrets.token_hex(12)}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind("\0" + name)
                sock.listen(backlog)
                self.unix, self.unix_name = sock, name
            except OSError as exc:
                logger.debug("no Unix-domain listener (%s); same-host peers use TCP", exc)
                sock.close()
        self.address = json.dumps({
            "tcp": f"{listen_host}:{self.tcp.getsockname()[1]}",
            "unix": self.unix_name,
            "machine": self.machine,
        })

    def sockets(self) -> list[socket.socket]:
        return [s for s in (self.tcp, self.unix) if s is not None]

    def close(self) -> None:
        for sock in self.sockets():
            sock.close()


def connect_mesh(
    rank: int,
    members: list[int],
    store: RendezvousClient,
    scope: str,
    secret: bytes,
    listen_host: str,
    timeout: float,
    buffer_bytes: int,
    unix_sockets: bool = True,
) -> dict[int, socket.socket]:
    """Open one authenticated socket to every other member; keys are member indices.

    ``members`` lists global ranks; ``rank`` is this process's index in it. Raises TransportError
    naming the global ranks that never published an address or connected within ``timeout`` s.
    """
    size = len(members)
    if size == 1:
        return {}
    digest = _scope_digest(scope)
    listeners = _Listeners(listen_host, unix_sockets, backlog=max(16, size))
    store.set(f"{scope}/addr/{members[rank]}", listeners.address.encode())

    peers: dict[int, socket.socket] = {}
    lock = threading.Lock()
    all_accepted = threading.Event()
    expected_higher = size - 1 - rank
    if expected_higher == 0:
        all_accepted.set()
    deadline = time.monotonic() + timeout
    stop = threading.Event()

    def handshake(conn: socket.socket, addr: object) -> None:
        try:
            conn.settimeout(None)
            authenticate_as_server(conn, secret, timeout=HANDSHAKE_TIMEOUT)
            conn.settimeout(HANDSHAKE_TIMEOUT)
            peer_rank, peer_digest = _HELLO.unpack(recv_exact(conn, _HELLO.size))
            conn.settimeout(None)
        except (AuthenticationError, RendezvousError, OSError) as exc:
            logger.warning("rank %d refused a peer connection from %s: %s", members[rank], addr or "a local socket", exc)
            conn.close()
            return
        with lock:
            if peer_digest != digest or not rank < peer_rank < size or peer_rank in peers:
                logger.warning("rank %d refused a connection claiming member %d of another communicator",
                               members[rank], peer_rank)
                conn.close()
                return
            tune_socket(conn, buffer_bytes)
            peers[peer_rank] = conn
            if sum(1 for p in peers if p > rank) == expected_higher:
                all_accepted.set()

    def accept_loop() -> None:
        with selectors.DefaultSelector() as selector:
            for sock in listeners.sockets():
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            while not stop.is_set() and not all_accepted.is_set():
                for key, _ in selector.select(timeout=0.1):
                    try:
                        conn, addr = key.fileobj.accept()
                    except (BlockingIOError, OSError):
                        continue
                    conn.setblocking(True)
                    threading.Thread(target=handshake, args=(conn, addr), name="hora-mesh-handshake",
                                     daemon=True).start()

    acceptor = threading.Thread(target=accept_loop, name="hora-mesh-accept", daemon=True)
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
            address = json.loads(store.get(keys[lower], timeout).decode())
            conn = _dial(address, listeners.machine, deadline, members[lower])
            conn.settimeout(None)
            authenticate_as_client(conn, secret, timeout=HANDSHAKE_TIMEOUT)
            conn.sendall(_HELLO.pack(rank, digest))
            tune_socket(conn, buffer_bytes)
            with lock:
                peers[lower] = conn
        if not all_accepted.wait(max(0.0, deadline - time.monotonic())):
            with lock:
                missing_ranks = [members[i] for i in range(rank + 1, size) if i not in peers]
            raise TransportError(
                f"rank {members[rank]}: ranks {missing_ranks} never connected within {timeout:.0f} s"
            )
    except BaseException:
        with lock:
            for sock in peers.values():
                sock.close()
        raise
    finally:
        stop.set()
        acceptor.join(timeout=1.0)
        listeners.close()
    return peers


def _dial(address: dict, my_machine: str, deadline: float, peer: int) -> socket.socket:
    if address.get("unix") and my_machine and address.get("machine") == my_machine:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("\0" + address["unix"])
            return sock
        except OSError as exc:
            sock.close()
            logger.debug("Unix-domain connection to rank %d failed (%s); using TCP", peer, exc)
    host, port_text = address["tcp"].rsplit(":", 1)
    while True:
        try:
            return socket.create_connection((host, int(port_text)), timeout=max(0.5, deadline - time.monotonic()))
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TransportError(f"cannot connect to rank {peer} at {host}:{port_text}: {exc}") from None
            time.sleep(0.05)
