"""Authenticated stream connections between members of a communicator.

:class:`LazyMesh` (what the TCP and shared-memory transports use) opens each connection the first
time a collective needs it, so a process holds sockets only to the peers its algorithms talk to;
:func:`connect_mesh` opens every pair up front (the MPI transport's lifelines need that).

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
from typing import Any, cast

from hora.errors import AuthenticationError, PeerFailureError, RendezvousError, TransportError
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
        address: str = probe.getsockname()[0]
        return address
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


def _server_handshake(conn: socket.socket, secret: bytes) -> tuple[int, bytes]:
    """Prove the dialer holds the job secret, then read who it claims to be: (member, scope digest)."""
    conn.settimeout(None)
    authenticate_as_server(conn, secret, timeout=HANDSHAKE_TIMEOUT)
    conn.settimeout(HANDSHAKE_TIMEOUT)
    peer_rank, peer_digest = _HELLO.unpack(recv_exact(conn, _HELLO.size))
    conn.settimeout(None)
    return peer_rank, peer_digest


def _client_handshake(conn: socket.socket, secret: bytes, rank: int, digest: bytes) -> None:
    conn.settimeout(None)
    authenticate_as_client(conn, secret, timeout=HANDSHAKE_TIMEOUT)
    conn.sendall(_HELLO.pack(rank, digest))


def _never_checked_in(me: int, missing_keys: list[str], timeout: float) -> TransportError:
    ranks = sorted(int(k.rsplit("/", 1)[1]) for k in missing_keys)
    return TransportError(
        f"rank {me}: ranks {ranks} never checked in within {timeout:.0f} s; "
        "did they crash or start late? (raise HORA_START_TIMEOUT if they are just slow)"
    )


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
            peer_rank, peer_digest = _server_handshake(conn, secret)
        except (AuthenticationError, RendezvousError, OSError) as exc:
            logger.warning("rank %d refused a peer connection from %s: %s", members[rank],
                           addr or "a local socket", exc)
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
                        conn, addr = cast(socket.socket, key.fileobj).accept()  # listeners alone
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
            raise _never_checked_in(members[rank], missing, timeout)
        for lower in range(rank):
            address = json.loads(store.get(keys[lower], timeout).decode())
            conn = _dial(address, listeners.machine, deadline, members[lower])
            _client_handshake(conn, secret, rank, digest)
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


def _dial(address: dict[str, Any], my_machine: str, deadline: float, peer: int) -> socket.socket:
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


class LazyMesh:
    """Authenticated connections to the members of a communicator, each opened on first use.

    A full mesh costs every process n - 1 sockets and the job n^2 handshakes, most never used once
    the algorithms talk only to ring neighbours and tree partners. Here each member listens for the
    communicator's lifetime and publishes its address at once; a connection opens the first time a
    collective needs it. The higher-ranked member of a pair always dials, the lower one accepts, so
    a pair never ends up with two connections; since both members of a pair take part in every
    collective that uses their link, the accepting side only ever waits for a peer that is on its
    way into the same collective. That wait is bounded by the transport time-out, and while it
    waits it watches the communicator's abort record, so a rank whose partner died before ever
    connecting still fails within a fraction of a second of the first survivor that noticed.
    """

    def __init__(
        self,
        rank: int,
        members: list[int],
        store: RendezvousClient,
        scope: str,
        secret: bytes,
        listen_host: str,
        start_timeout: float,
        buffer_bytes: int,
        unix_sockets: bool = True,
    ) -> None:
        self._rank = rank
        self._members = members
        self._store = store
        self._scope = scope
        self._secret = secret
        self._digest = _scope_digest(scope)
        self._buffer_bytes = buffer_bytes
        self._start_timeout = start_timeout
        self._peers: dict[int, socket.socket] = {}
        self._ready = threading.Condition()
        self._cut = False
        self._stop = threading.Event()
        self._listeners: _Listeners | None = None
        self._acceptor: threading.Thread | None = None
        if len(members) == 1:
            return
        self._listeners = _Listeners(listen_host, unix_sockets, backlog=max(16, min(len(members), 128)))
        store.set(f"{scope}/addr/{members[rank]}", self._listeners.address.encode())
        self._acceptor = threading.Thread(target=self._accept_loop, name="hora-mesh-accept", daemon=True)
        self._acceptor.start()
        # One round trip: every member has checked in (so a dial later finds a listener), and a
        # member that never started is named now rather than at its first use.
        missing = store.wait([f"{scope}/addr/{m}" for m in members], start_timeout)
        if missing:
            self.close()
            raise _never_checked_in(members[rank], missing, start_timeout)

    # ---- opening connections --------------------------------------------------------------------

    def connected(self) -> list[int]:
        """Member indices this rank holds a connection to."""
        with self._ready:
            return sorted(self._peers)

    def sockets(self) -> list[socket.socket]:
        with self._ready:
            return list(self._peers.values())

    def get(self, peer: int, timeout: float) -> tuple[socket.socket, bool]:
        """The connection to member ``peer`` and whether it was opened by this call.

        Raises :class:`PeerFailureError` naming the peer when it cannot be reached within
        ``timeout`` s, or the failure another rank recorded meanwhile.
        """
        sock = self._peers.get(peer)
        if sock is not None:
            return sock, False
        if self._cut:
            raise PeerFailureError(f"rank {self._members[peer]} is unreachable: this rank's connections "
                                   "were cut after a failure", self._members[peer])
        if peer < self._rank:
            return self._dial(peer, timeout), True
        return self._await(peer, timeout), True

    def _dial(self, peer: int, timeout: float) -> socket.socket:
        member = self._members[peer]
        deadline = time.monotonic() + timeout
        try:
            address = json.loads(self._store.get(f"{self._scope}/addr/{member}", timeout).decode())
            conn = _dial(address, self._listeners.machine if self._listeners else "", deadline, member)
            _client_handshake(conn, self._secret, self._rank, self._digest)
        except (AuthenticationError, RendezvousError, TransportError, OSError) as exc:
            raise PeerFailureError(f"cannot open a connection to rank {member}: {exc}", member) from None
        tune_socket(conn, self._buffer_bytes)
        with self._ready:
            if self._cut:
                conn.close()
                raise PeerFailureError(f"rank {member} is unreachable: this rank's connections were cut "
                                       "after a failure", member)
            self._peers[peer] = conn
        return conn

    def _await(self, peer: int, timeout: float) -> socket.socket:
        member = self._members[peer]
        deadline = time.monotonic() + timeout
        abort_key = f"{self._scope}/abort"
        with self._ready:
            while peer not in self._peers:
                left = deadline - time.monotonic()
                if self._cut:
                    raise PeerFailureError(f"rank {member} is unreachable: this rank's connections were cut "
                                           "after a failure", member)
                if left <= 0:
                    raise PeerFailureError(
                        f"rank {member} did not connect for {timeout:.0f} s (it may be hung, dead or stuck "
                        "outside the collective; see HORA_TRANSPORT_TIMEOUT)", member, timed_out=True)
                self._ready.wait(min(left, 0.25))
                if peer in self._peers:
                    break
                try:
                    record = self._store.try_get(abort_key)
                except Exception:  # the store may be gone with the launcher
                    record = None
                if record is not None:
                    root = json.loads(record)
                    raise PeerFailureError(
                        f"rank {root.get('detected_by')} reported: {root.get('reason')}", root.get("failed_rank"))
            return self._peers[peer]

    def _handshake(self, conn: socket.socket, addr: object) -> None:
        me = self._members[self._rank]
        try:
            peer, digest = _server_handshake(conn, self._secret)
        except (AuthenticationError, RendezvousError, OSError) as exc:
            logger.warning("rank %d refused a peer connection from %s: %s", me, addr or "a local socket", exc)
            conn.close()
            return
        with self._ready:
            if digest != self._digest or not self._rank < peer < len(self._members) or peer in self._peers:
                logger.warning("rank %d refused a connection claiming member %d of another communicator", me, peer)
                conn.close()
                return
            if self._cut or self._stop.is_set():
                conn.close()  # the dialer sees EOF and fails at once
                return
            tune_socket(conn, self._buffer_bytes)
            self._peers[peer] = conn
            self._ready.notify_all()

    def _accept_loop(self) -> None:
        assert self._listeners is not None
        with selectors.DefaultSelector() as selector:
            for sock in self._listeners.sockets():
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                try:
                    events = selector.select(timeout=0.5)
                except (OSError, ValueError):
                    return  # listeners closed
                for key, _ in events:
                    try:
                        conn, addr = cast(socket.socket, key.fileobj).accept()  # listeners alone
                    except (BlockingIOError, OSError):
                        continue
                    conn.setblocking(True)
                    threading.Thread(target=self._handshake, args=(conn, addr), name="hora-mesh-handshake",
                                     daemon=True).start()

    # ---- closing --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Shut every connection and refuse new ones (idempotent): peers blocked on this rank fail."""
        with self._ready:
            self._cut = True
            peers = list(self._peers.values())
            self._ready.notify_all()
        for sock in peers:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.shutdown()
        if self._acceptor is not None and self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=1.0)
        if self._listeners is not None:
            self._listeners.close()
        with self._ready:
            for sock in self._peers.values():
                sock.close()
            self._peers.clear()
