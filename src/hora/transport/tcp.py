"""The built-in transport: collectives over authenticated TCP (or same-host Unix) connections.

Large messages use bandwidth-optimal ring algorithms (allreduce = reduce-scatter then allgather),
cut into chunks and pipelined: a sender thread streams chunk k to the next rank while this thread
receives and reduces chunk k+1 from the previous one. Small messages (``ring_small_bytes``) among at
most ``DIRECT_MAX_PEERS`` ranks use one-round direct exchanges, which cost a single network latency
instead of 2(p-1); in larger groups they use recursive doubling (allreduce, barrier) and binomial
trees (broadcast, object gather and broadcast): log2(p) rounds, each rank talking to its log2(p)
partners at distance 2^k only. Connections open on first use (:class:`LazyMesh`), so a process
holds sockets to its ring neighbours and tree partners, not to the whole job. Reductions combine
operands in an order fixed by rank, so all ranks finish with bit-identical results.

Failure: a peer that exits shows up as EOF or a reset at once; a peer that hangs shows up as no
progress for ``transport_timeout`` seconds. Either way this rank records the failure in the
rendezvous store (so other ranks can name the root cause, not just their neighbour), shuts its
sockets (so ranks blocked on it fail at once too) and raises :class:`PeerFailureError` (see
:mod:`hora.transport.guard`).
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hora import config
from hora.errors import PeerFailureError
from hora.rendezvous.auth import secret_bytes
from hora.rendezvous.client import RendezvousClient
from hora.transport.base import MemberCommunicator, ReduceOp, check_buffer, check_counts, check_root
from hora.transport.guard import CollectiveGuard
from hora.transport.layout import bytes_of, count_offsets, split_offsets
from hora.transport.reduce import check_op, reduction_ufunc
from hora.transport.scratch import ScratchArrays
from hora.transport.sender import AsyncSender
from hora.transport.tcp_mesh import LazyMesh, route_address

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!Q")
_TIMEVAL = struct.Struct("ll")
DIRECT_MAX_PEERS = 8


class TcpCommunicator(MemberCommunicator):
    """Ring and direct collectives over authenticated TCP sockets."""

    name = "tcp"

    def __init__(
        self,
        rank: int,
        members: Sequence[int],
        store: RendezvousClient,
        scope: str,
        secret: str | bytes,
        timeout: float | None = None,
        listen_host: str | None = None,
    ) -> None:
        self._members = [int(m) for m in members]
        if not 0 <= rank < len(self._members):
            raise ValueError(f"rank {rank} is outside a communicator of {len(self._members)} members")
        self._rank = rank
        self.timeout = float(timeout if timeout is not None else config.get("transport_timeout"))
        self.chunk_bytes = max(4096, int(config.get("ring_chunk_bytes")))
        self.small_bytes = int(config.get("ring_small_bytes"))
        host = listen_host or config.get("iface") or route_address(store.host, store.port)
        self._links = LazyMesh(
            rank,
            self._members,
            store,
            scope,
            secret_bytes(secret),
            host,
            start_timeout=float(config.get("start_timeout")),
            buffer_bytes=int(config.get("socket_buffer_bytes")),
            unix_sockets=bool(config.get("unix_sockets")),
        )
        self._peers: dict[int, socket.socket] = {}
        # Per peer: a message this small fits in the kernel's buffers, so it may be sent inline (no
        # thread handoff) even while the peer is sending to us: neither side can block the other.
        self._inline_limit: dict[int, int] = {}
        #: Point-to-point messages sent by the small-message and object paths (direct, doubling,
        #: trees): what the engine's control plane costs per cycle (benchmarks/scaling_one_host.py).
        self.small_messages_sent = 0
        self._inline_bytes = 0  # sent on the caller's thread; the sender thread counts its own
        self._sender = AsyncSender(name=f"hora-send-{self.global_rank}")
        self._scratch = ScratchArrays()  # ring chunk and reduce-scatter work arrays, reused
        # The guard every collective runs in: one collective at a time, refused once failed, and any
        # failure inside recorded for the peers and raised with its root cause.
        self._guard = CollectiveGuard(store, scope, self._members, rank, self.timeout,
                                      cut=self.shutdown_connections, flush=self._sender.flush)

    @property
    def bytes_sent(self) -> int:
        return self._inline_bytes + self._sender.bytes_queued

    # ---- sockets ------------------------------------------------------------------------------

    def _sock(self, peer: int) -> socket.socket:
        """The connection to member ``peer``, opened (and authenticated) on first use."""
        sock = self._peers.get(peer)
        if sock is None:
            sock, _ = self._links.get(peer, self.timeout)
            self._set_timeouts(sock)
            self._inline_limit[peer] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4
            self._peers[peer] = sock
        return sock

    def connected_peers(self) -> list[int]:
        """Member indices this rank has opened a connection to (they grow with use, not with size)."""
        return self._links.connected()

    def _set_timeouts(self, sock: socket.socket) -> None:
        """OS-level timeouts keep sockets blocking (one syscall per chunk) yet bounded."""
        sock.settimeout(None)
        seconds = int(self.timeout)
        tv = _TIMEVAL.pack(seconds, int((self.timeout - seconds) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    # ---- failure handling ---------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._guard.closed:
            self._guard.check_open(what)

    def shutdown_connections(self) -> None:
        """Shut every peer connection (idempotent): peers blocked on this rank fail at once, and
        this communicator's later collectives fail instead of waiting."""
        self._links.shutdown()

    def _recv_into(self, peer: int, view: memoryview) -> None:
        sock = self._sock(peer)
        need = len(view)
        got = 0
        while got < need:
            try:
                n = sock.recv_into(view[got:], need - got, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError):
                raise PeerFailureError(
                    f"no data from rank {self._members[peer]} for {self.timeout:.0f} s "
                    "(it may be hung or stuck outside the collective; see HORA_TRANSPORT_TIMEOUT)",
                    self._members[peer],
                    timed_out=True,
                ) from None
            except OSError as exc:
                raise PeerFailureError(
                    f"connection to rank {self._members[peer]} broke ({exc}); it probably died",
                    self._members[peer],
                ) from None
            if n == 0:
                raise PeerFailureError(
                    f"rank {self._members[peer]} closed its connection (it exited or crashed)",
                    self._members[peer],
                )
            got += n

    def _send_now(self, peer: int, view: memoryview) -> None:
        """Send inline when the message fits in the socket buffers, else through the sender thread."""
        if not len(view):
            return
        self.small_messages_sent += 1
        sock = self._sock(peer)
        if len(view) > self._inline_limit[peer]:
            self._sender.send(sock, view)
            return
        self._inline_bytes += view.nbytes
        try:
            sock.sendall(view)
        except OSError as exc:
            raise PeerFailureError(
                f"sending to rank {self._members[peer]} failed ({exc}); it probably died",
                self._members[peer],
            ) from None

    def _chunks(self, start: int, stop: int, itemsize: int) -> Iterator[tuple[int, int]]:
        step = max(1, self.chunk_bytes // itemsize)
        for lo in range(start, stop, step):
            yield lo, min(stop, lo + step)

    def _use_direct(self, nbytes: int) -> bool:
        return nbytes <= self.small_bytes and self.size <= DIRECT_MAX_PEERS

    def _use_tree(self, nbytes: int) -> bool:
        """Small messages among more ranks than a direct exchange suits: log2(p) rounds."""
        return nbytes <= self.small_bytes and self.size > DIRECT_MAX_PEERS

    def _exchange(self, peer: int, send: memoryview, recv: memoryview) -> None:
        """Send ``send`` to and receive ``recv`` from ``peer``; ``send`` may be reused on return."""
        self._send_now(peer, send)
        self._recv_into(peer, recv)
        if len(send) > self._inline_limit[peer]:
            self._sender.flush(self.timeout)  # went through the sender thread: wait before reuse

    def _tree(self, root: int) -> tuple[int | None, list[int]]:
        """This rank's parent (None at the root) and children, largest subtree first, in the
        binomial tree rooted at ``root``: partners are at distance 2^k around the ring."""
        n = self.size
        rel = (self._rank - root) % n
        if rel:
            low = rel & -rel
            parent: int | None = (rel - low + root) % n
        else:
            low, parent = 1 << (n - 1).bit_length(), None
        children = []
        step = low >> 1
        while step:
            if rel + step < n:
                children.append((rel + step + root) % n)
            step >>= 1
        return parent, children

    # ---- allreduce ----------------------------------------------------------------------------

    def allreduce(self, buf: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> None:
        self._check_open("allreduce")
        check_buffer(buf)
        check_op(op, buf.dtype)
        if self.size == 1 or buf.size == 0:
            return
        flat = buf.reshape(-1)
        with self._guard("allreduce", flat.dtype):
            if self._use_direct(flat.nbytes):
                self._allreduce_direct(flat, op)
            elif self._use_tree(flat.nbytes):
                self._allreduce_doubling(flat, op)
            else:
                self._reduce_scatter_ring(flat, flat, split_offsets(flat.size, self.size), op, own_shift=1)
                self._allgather_ring(flat, split_offsets(flat.size, self.size), shift=1)

    def _allreduce_direct(self, flat: np.ndarray, op: ReduceOp) -> None:
        ufunc = reduction_ufunc(op, flat.dtype)
        mine = bytes_of(flat)
        for peer in self._ring_order():
            self._send_now(peer, mine)
        received: dict[int, np.ndarray] = {}
        for peer in self._ring_order(reverse=True):
            tmp = np.empty_like(flat)
            self._recv_into(peer, bytes_of(tmp))
            received[peer] = tmp
        received[self._rank] = flat
        # Reduce in rank order on every rank so every rank ends with the same bits.
        acc = flat if self._rank == 0 else received[0]
        for r in range(1, self.size):
            ufunc(acc, received[r], out=acc)
        if acc is not flat:
            flat[...] = acc

    def _allreduce_doubling(self, flat: np.ndarray, op: ReduceOp) -> None:
        """Recursive doubling: log2(p) exchanges with the partners at distance 1, 2, 4, ...

        A rank beyond the largest power of two p2 first hands its input to rank - p2 and gets the
        result back at the end. Each exchange combines the lower-ranked partner's operand first, and
        after the exchange at distance d every block of 2d ranks holds the same bits, so every rank
        finishes with the same bits.
        """
        n, r = self.size, self._rank
        p2 = 1 << (n.bit_length() - 1)
        ufunc = reduction_ufunc(op, flat.dtype)
        mine = bytes_of(flat)
        if r >= p2:
            self._send_now(r - p2, mine)
            self._sender.flush(self.timeout)
            self._recv_into(r - p2, mine)
            return
        other = np.empty_like(flat)
        theirs = bytes_of(other)
        if r + p2 < n:
            self._recv_into(r + p2, theirs)
            ufunc(flat, other, out=flat)
        distance = 1
        while distance < p2:
            partner = r ^ distance
            self._exchange(partner, mine, theirs)
            if partner < r:
                ufunc(other, flat, out=flat)
            else:
                ufunc(flat, other, out=flat)
            distance <<= 1
        if r + p2 < n:
            self._send_now(r + p2, mine)

    def _ring_order(self, reverse: bool = False) -> list[int]:
        """Peers nearest first along the ring: next, next+1, ... (or prev, prev-1, ...)."""
        sign = -1 if reverse else 1
        return [(self._rank + sign * k) % self.size for k in range(1, self.size)]

    def _reduce_scatter_ring(
        self,
        src: np.ndarray,
        work: np.ndarray,
        offsets: list[int],
        op: ReduceOp,
        own_shift: int,
    ) -> None:
        """Ring reduce-scatter: afterwards segment ``(rank + own_shift) % size`` of ``work`` is reduced.

        At step t this rank sends segment ``rank - t + own_shift - 1`` and receives (and reduces)
        segment ``rank - t + own_shift - 2``. ``src`` holds this rank's input; ``work`` receives
        partial sums (they may be the same array: in-place allreduce).
        """
        n, r = self.size, self._rank
        nxt, prv = (r + 1) % n, (r - 1) % n
        ufunc = reduction_ufunc(op, src.dtype)
        itemsize = src.itemsize
        next_sock = self._sock(nxt)
        src_bytes, work_bytes = bytes_of(src), bytes_of(work)
        scratch = self._scratch.get("chunk", max(1, self.chunk_bytes // itemsize), src.dtype)
        scratch_bytes = bytes_of(scratch)

        first = (r + own_shift - 1) % n
        for lo, hi in self._chunks(offsets[first], offsets[first + 1], itemsize):
            self._sender.send(next_sock, src_bytes[lo * itemsize : hi * itemsize])
        for t in range(n - 1):
            seg = (r - t + own_shift - 2) % n
            last = t == n - 2
            for lo, hi in self._chunks(offsets[seg], offsets[seg + 1], itemsize):
                count = hi - lo
                self._recv_into(prv, scratch_bytes[: count * itemsize])
                # Incoming partial sum first: the ring fixes the order, so results are deterministic.
                ufunc(scratch[:count], src[lo:hi], out=work[lo:hi])
                if not last:
                    self._sender.send(next_sock, work_bytes[lo * itemsize : hi * itemsize])

    def _allgather_ring(self, buf: np.ndarray, offsets: list[int], shift: int) -> None:
        """Ring allgather in place: this rank starts owning segment ``(rank + shift) % size``."""
        n, r = self.size, self._rank
        nxt, prv = (r + 1) % n, (r - 1) % n
        itemsize = buf.itemsize
        next_sock = self._sock(nxt)
        data = bytes_of(buf)
        own = (r + shift) % n
        for lo, hi in self._chunks(offsets[own], offsets[own + 1], itemsize):
            self._sender.send(next_sock, data[lo * itemsize : hi * itemsize])
        for t in range(n - 1):
            seg = (r + shift - t - 1) % n
            forward = t < n - 2
            for lo, hi in self._chunks(offsets[seg], offsets[seg + 1], itemsize):
                view = data[lo * itemsize : hi * itemsize]
                self._recv_into(prv, view)
                if forward:
                    self._sender.send(next_sock, view)

    # ---- allgather ----------------------------------------------------------------------------

    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        self._check_open("allgather")
        check_buffer(send, "send buffer")
        check_buffer(recv, "receive buffer")
        counts = check_counts(counts, self.size, "counts")
        if recv.dtype != send.dtype:
            raise TypeError(f"send dtype {send.dtype} and receive dtype {recv.dtype} differ")
        if send.size != counts[self._rank]:
            raise ValueError(
                f"rank {self.global_rank}: send buffer holds {send.size} elements but counts says "
                f"{counts[self._rank]}"
            )
        offsets = count_offsets(counts)
        if recv.size != offsets[-1]:
            raise ValueError(f"receive buffer holds {recv.size} elements; counts add up to {offsets[-1]}")
        flat = recv.reshape(-1)
        flat[offsets[self._rank] : offsets[self._rank + 1]] = send.reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        with self._guard("allgather"):
            if self._use_direct(flat.nbytes):
                data = bytes_of(flat)
                isz = flat.itemsize
                mine = data[offsets[self._rank] * isz : offsets[self._rank + 1] * isz]
                for peer in self._ring_order():
                    self._send_now(peer, mine)
                for peer in self._ring_order(reverse=True):
                    self._recv_into(peer, data[offsets[peer] * isz : offsets[peer + 1] * isz])
            else:
                self._allgather_ring(flat, offsets, shift=0)

    # ---- broadcast ----------------------------------------------------------------------------

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self._check_open("broadcast")
        check_buffer(buf)
        check_root(root, self.size)
        if self.size == 1 or buf.size == 0:
            return
        data = bytes_of(buf)
        with self._guard("broadcast"):
            if self._use_direct(buf.nbytes):
                if self._rank == root:
                    for peer in range(self.size):
                        if peer != root:
                            self._send_now(peer, data)
                else:
                    self._recv_into(root, data)
                return
            if self._use_tree(buf.nbytes):
                parent, children = self._tree(root)
                if parent is not None:
                    self._recv_into(parent, data)
                for child in children:
                    self._send_now(child, data)
                return
            # Pipelined chain root -> root+1 -> ... -> root-1: time ~ S/B, independent of size.
            pos = (self._rank - root) % self.size
            nxt, prv = (self._rank + 1) % self.size, (self._rank - 1) % self.size
            forward = pos < self.size - 1
            for lo, hi in self._chunks(0, buf.nbytes, 1):
                view = data[lo:hi]
                if pos:
                    self._recv_into(prv, view)
                if forward:
                    self._sender.send(self._sock(nxt), view)

    # ---- alltoall -----------------------------------------------------------------------------

    def alltoall(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> None:
        self._check_open("alltoall")
        check_buffer(send, "send buffer")
        check_buffer(recv, "receive buffer")
        if recv.dtype != send.dtype:
            raise TypeError(f"send dtype {send.dtype} and receive dtype {recv.dtype} differ")
        send_counts = check_counts(send_counts, self.size, "send_counts")
        recv_counts = check_counts(recv_counts, self.size, "recv_counts")
        soff, roff = count_offsets(send_counts), count_offsets(recv_counts)
        if send.size != soff[-1]:
            raise ValueError(f"send buffer holds {send.size} elements; send_counts add up to {soff[-1]}")
        if recv.size != roff[-1]:
            raise ValueError(f"receive buffer holds {recv.size} elements; recv_counts add up to {roff[-1]}")
        sflat, rflat = send.reshape(-1), recv.reshape(-1)
        r = self._rank
        if send_counts[r] != recv_counts[r]:
            raise ValueError(
                f"rank {self.global_rank} sends itself {send_counts[r]} elements but expects {recv_counts[r]}"
            )
        rflat[roff[r] : roff[r + 1]] = sflat[soff[r] : soff[r + 1]]
        if self.size == 1:
            return
        isz = send.itemsize
        sdata, rdata = bytes_of(sflat), bytes_of(rflat)
        with self._guard("alltoall"):
            # Step k: send to rank+k, receive from rank-k; the global step order prevents deadlock.
            # Pairs that exchange nothing need no connection (sparse exchanges stay sparse).
            for peer in self._ring_order():
                if send_counts[peer]:
                    self._sender.send(self._sock(peer), sdata[soff[peer] * isz : soff[peer + 1] * isz])
            for peer in self._ring_order(reverse=True):
                if recv_counts[peer]:
                    self._recv_into(peer, rdata[roff[peer] * isz : roff[peer + 1] * isz])

    # ---- reducescatter ------------------------------------------------------------------------

    def reducescatter(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: ReduceOp = ReduceOp.SUM
    ) -> None:
        self._check_open("reducescatter")
        check_buffer(send, "send buffer")
        check_buffer(recv, "receive buffer")
        check_op(op, send.dtype)
        if recv.dtype != send.dtype:
            raise TypeError(f"send dtype {send.dtype} and receive dtype {recv.dtype} differ")
        counts = check_counts(counts, self.size, "counts")
        offsets = count_offsets(counts)
        if send.size != offsets[-1]:
            raise ValueError(f"send buffer holds {send.size} elements; counts add up to {offsets[-1]}")
        if recv.size != counts[self._rank]:
            raise ValueError(
                f"rank {self.global_rank}: receive buffer holds {recv.size} elements, counts says "
                f"{counts[self._rank]}"
            )
        sflat, rflat = send.reshape(-1), recv.reshape(-1)
        lo, hi = offsets[self._rank], offsets[self._rank + 1]
        if self.size == 1:
            rflat[...] = sflat[lo:hi]
            return
        with self._guard("reducescatter", send.dtype):
            if self._use_direct(send.nbytes):
                self._reducescatter_direct(sflat, rflat, offsets, op)
            else:
                work = self._scratch.get("work", sflat.size, sflat.dtype)
                self._reduce_scatter_ring(sflat, work, offsets, op, own_shift=0)
                rflat[...] = work[lo:hi]

    def _reducescatter_direct(
        self, sflat: np.ndarray, rflat: np.ndarray, offsets: list[int], op: ReduceOp
    ) -> None:
        ufunc = reduction_ufunc(op, sflat.dtype)
        isz = sflat.itemsize
        sdata = bytes_of(sflat)
        for peer in self._ring_order():
            self._send_now(peer, sdata[offsets[peer] * isz : offsets[peer + 1] * isz])
        lo, hi = offsets[self._rank], offsets[self._rank + 1]
        parts: dict[int, np.ndarray] = {self._rank: sflat[lo:hi]}
        for peer in self._ring_order(reverse=True):
            tmp = np.empty(hi - lo, dtype=sflat.dtype)
            self._recv_into(peer, bytes_of(tmp))
            parts[peer] = tmp
        rflat[...] = parts[0]
        for r in range(1, self.size):
            ufunc(rflat, parts[r], out=rflat)

    # ---- control ------------------------------------------------------------------------------

    def barrier(self) -> None:
        self._check_open("barrier")
        token = np.zeros(1, dtype=np.uint8)
        self.allreduce(token, ReduceOp.SUM)

    def _send_object(self, peer: int, payload: bytes) -> None:
        self.small_messages_sent += 1
        self._sender.send(self._sock(peer), memoryview(_LEN.pack(len(payload)) + payload))

    def _recv_payload(self, peer: int) -> bytes:
        header = bytearray(_LEN.size)
        self._recv_into(peer, memoryview(header))
        (length,) = _LEN.unpack(header)
        payload = bytearray(length)
        self._recv_into(peer, memoryview(payload))
        return bytes(payload)

    def _recv_object(self, peer: int) -> Any:
        return pickle.loads(self._recv_payload(peer))  # the peer proved it holds the job secret

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        self._check_open("gather_object")
        check_root(root, self.size)
        if self.size == 1:
            return [obj]
        with self._guard("gather_object"):
            if self.size > DIRECT_MAX_PEERS:
                return self._gather_object_tree(obj, root)
            if self._rank != root:
                self._send_object(root, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
                return None
            out: list[Any] = [None] * self.size
            out[root] = obj
            for peer in range(self.size):
                if peer != root:
                    out[peer] = self._recv_object(peer)
            return out

    def _gather_object_tree(self, obj: Any, root: int) -> list[Any] | None:
        """Up the binomial tree: each rank forwards its subtree's pickled objects as one message
        (inner ranks never unpickle the payloads they carry)."""
        parent, children = self._tree(root)
        carried = [(self._rank, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))]
        for child in reversed(children):  # smallest subtree first: it is ready first
            carried.extend(self._recv_object(child))
        if parent is not None:
            self._send_object(parent, pickle.dumps(carried, protocol=pickle.HIGHEST_PROTOCOL))
            return None
        out: list[Any] = [None] * self.size
        for member, payload in carried:
            out[member] = obj if member == root else pickle.loads(payload)
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_open("broadcast_object")
        check_root(root, self.size)
        if self.size == 1:
            return obj
        with self._guard("broadcast_object"):
            if self.size > DIRECT_MAX_PEERS:
                parent, children = self._tree(root)
                if parent is None:
                    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                else:
                    payload = self._recv_payload(parent)
                    obj = pickle.loads(payload)
                for child in children:
                    self._send_object(child, payload)
                return obj
            if self._rank == root:
                payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                for peer in range(self.size):
                    if peer != root:
                        self._send_object(peer, payload)
                return obj
            return self._recv_object(root)

    def close(self) -> None:
        if self._guard.closed:
            return
        self._guard.closed = True
        self._sender.close()
        self._links.close()
        self._peers.clear()
        self._scratch.clear()

