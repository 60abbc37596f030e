"""Shared-memory transport for ranks on one host.

Every rank maps every other rank's segment (see :mod:`shm_segment`). An allreduce then moves no
bytes through the kernel at all: each rank reduces its 1/n share of the buffer by reading that share
from every segment, and everyone copies the finished shares out. If the caller's buffer already lives
in this rank's segment (the engine's fusion buffer does: :meth:`allocate`), nothing is copied in.

Ranks synchronise through counters in their segments: each rank writes only its own, and waits by
polling the others' (yielding the GIL while it waits). A peer that dies is noticed by its process
disappearing or its abort flag, within milliseconds. Collectives that gain nothing from shared memory
(alltoall, object exchange, messages larger than the segment limit) go through a TCP communicator
among the same ranks, which this communicator holds; its connections open on first use and its object
collectives run over binomial trees, so a process holds O(log n) sockets, not n - 1. The TCP side and
the segments share one failure record, and the liveness checks cover every rank of the host whether
or not this rank ever connected to it.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from hora import config
from hora.errors import PeerFailureError
from hora.rendezvous.client import RendezvousClient
from hora.transport.base import (
    MemberCommunicator,
    ReduceOp,
    TransportUnavailable,
    check_buffer,
    check_counts,
    check_root,
)
from hora.transport.guard import CollectiveGuard
from hora.transport.layout import count_offsets, split_offsets
from hora.transport.reduce import check_op, reduction_ufunc
from hora.transport.scaling import scale_into
from hora.transport.shm_segment import SHM_DIR, SMALL_BYTES, Segment
from hora.transport.tcp import TcpCommunicator
from hora.transport.tcp_mesh import local_machine_id
from hora.transport.timer_slack import fine_timer_slack

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

logger = logging.getLogger(__name__)

_EPOCH, _ABORT, _OFFSET = 0, 1, 2
#: How many times a wait checks a peer's epoch before it yields. A check is a few hundred times
#: cheaper than a yield, which gives up the core and pays the scheduler's wake-up, so when every rank
#: of the group has a core of its own, the spin adapts between these bounds (doubled when a peer
#: arrives during it, halved when it runs out): spinning first cuts a small allreduce's latency
#: (measured figures: docs/transports-and-tuning.md). When ranks outnumber cores, a waiting rank's
#: spin holds a core its peer needs: it stays at the minimum.
_SPIN_CHECKS_MIN = 50
_SPIN_CHECKS_MAX = 400
_YIELD_FOR_S = 0.0002
_MAX_NAP_S = 0.001
_LIVENESS_EVERY_S = 0.05
#: Chunk of :meth:`ShmCommunicator.allreduce_into`'s pipeline: small enough that a chunk copied in is
#: still in cache when it is reduced, large enough that the per-chunk synchronisation is noise.
_PIPELINE_BYTES = 2 * 1024 * 1024
#: Chunks that pipeline's ring holds in each segment (at least 3: see there).
_PIPELINE_RING = 6
#: A pickled object in a small-message slot: its length (int64; _TOO_LARGE: it did not fit, it goes over
#: the mesh; _UNPICKLABLE: pickling it failed on that rank), then its bytes.
_OBJECT_HEADER = 8
_TOO_LARGE = -1
_UNPICKLABLE = -2
_OBJECT_ROOM = SMALL_BYTES - _OBJECT_HEADER
_LENGTH = struct.Struct("<q")

_T = TypeVar("_T")


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def unavailable_reason() -> str | None:
    """Why ranks on this host cannot share memory here, or None when they can.

    It makes (and at once removes) a small segment the way the transport does, so it fails for the
    reason a job would: no /dev/shm, no permission to write there, a full tmpfs, or no
    ``posix_fallocate`` on this platform.
    """
    try:
        segment = Segment.create(f"hora-check-{os.getpid()}", 1)
    except (OSError, AttributeError) as exc:
        return f"cannot create a shared-memory segment in {SHM_DIR}: {exc}"
    segment.unlink()
    segment.close()
    return None


class ShmCommunicator(MemberCommunicator):
    """Collectives through shared memory among ranks of one host."""

    name = "shm"
    activity = "SHM"
    allocates_own_memory = True
    #: Buffers at least this large gain from living in :meth:`allocate`'s memory (smaller ones
    #: travel through the small-message slots, which copy anyway).
    staged_min_bytes = SMALL_BYTES + 1
    reduces_into = True

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
        self._segments: list[Segment] = []
        #: Views into the small-message slots, made once: (parity, bytes, dtype) -> every rank's slot as an
        #: array; ("object", member, parity) -> one slot as a memoryview.
        self._slot_views: dict[tuple[object, ...], Any] = {}
        # Same scope as this communicator: a failure seen on either is one record for every rank.
        self._mesh = TcpCommunicator(rank, members, store, scope, secret, timeout=timeout, listen_host=listen_host)
        self._members = [int(m) for m in members]
        self._rank = rank
        self._store = store
        self._scope = scope
        self.timeout = self._mesh.timeout
        self._guard = CollectiveGuard(store, scope, self._members, rank, self.timeout, cut=self._cut)
        try:
            machines = self._mesh.allgather_object(local_machine_id())
            if len(set(machines)) != 1 or not machines[0]:
                raise TransportUnavailable(
                    f"rank {self.global_rank}: the shared-memory transport needs every rank on one host; "
                    "use the tcp transport (or hierarchical allreduce) across hosts"
                )
            self._pids = self._mesh.allgather_object(os.getpid())
            self._max_bytes = int(config.get("shm_segment_bytes"))
            self._generation = 0
            self._epoch = 0
            self._spin_most = _SPIN_CHECKS_MAX if self.size <= _usable_cores() else _SPIN_CHECKS_MIN
            self._spin_checks = self._spin_most
            self._ensure(1 << 20)
        except BaseException:
            self.close()  # the mesh's sockets and threads, and any segment already mapped
            raise

    # ---- failure -----------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._guard.closed:
            self._guard.check_open(what)

    def _cut(self) -> None:
        """After a failure: tell peers polling this rank's segment, and shut the mesh's sockets."""
        if self._segments:
            self._own.ctrl[_ABORT] = 1
        self._mesh.shutdown_connections()

    def _via_mesh(self, what: str, call: Callable[..., _T], *args: Any) -> _T:
        """Run a collective on the TCP mesh; a failure there breaks this communicator too."""
        self._guard.check_usable(what)
        try:
            return call(*args)
        except PeerFailureError as exc:
            self._guard.adopt(exc)
            raise

    @property
    def bytes_sent(self) -> int:
        """What went through the TCP side (large objects, alltoall): the segments move no network bytes."""
        return self._mesh.bytes_sent

    # ---- segments -----------------------------------------------------------------------------

    @property
    def _own(self) -> Segment:
        return self._segments[self._rank]

    def _ensure(self, nbytes: int) -> bool:
        """Make every segment hold ``nbytes`` (collective: all ranks ask for the same size).

        Returns False when ``nbytes`` exceeds the configured maximum (callers then work in chunks).
        """
        if self._segments and self._own.capacity >= nbytes:
            return True
        if self._segments and self._own.capacity >= self._max_bytes:
            return False
        want = min(self._max_bytes, max(nbytes, 2 * (self._own.capacity if self._segments else 0)))
        self._generation += 1
        prefix = f"{self._scope}/shm/{self._generation}"
        mine: Segment | None
        try:
            mine = Segment.create(f"hora-{os.getpid()}", want)
            entry = f"{mine.path}:{mine.capacity}"
        except OSError as exc:  # /dev/shm full or missing: say so to the peers, who then agree to chunk
            logger.warning("rank %d: cannot create a %d-byte shared-memory segment (%s)", self.global_rank, want, exc)
            mine, entry = None, "unavailable"
        try:
            self._store.set(f"{prefix}/path/{self.global_rank}", entry.encode())
            keys = [f"{prefix}/path/{m}" for m in self._members]
            missing = self._store.wait(keys, self.timeout)
            if missing:
                raise self._no_progress(missing, "publish its shared memory")
            entries = [self._store.get(key, self.timeout).decode() for key in keys]
            if "unavailable" in entries:
                if mine is not None:
                    mine.close()
                self._max_bytes = self._own.capacity if self._segments else 0
                if not self._segments:
                    raise TransportUnavailable("shared memory is unavailable on this host (/dev/shm)")
                return False
            assert mine is not None  # else this rank's own entry is "unavailable"
            segments: list[Segment] = []
            try:
                for i, text in enumerate(entries):
                    path, cap = text.rsplit(":", 1)
                    segments.append(mine if i == self._rank else Segment.attach(path, int(cap)))
                self._store.set(f"{prefix}/attached/{self.global_rank}", b"1")
                missing = self._store.wait([f"{prefix}/attached/{m}" for m in self._members], self.timeout)
                if missing:
                    raise self._no_progress(missing, "map the shared memory")
            except BaseException:
                for segment in segments if mine in segments else [*segments, mine]:
                    if segment is not None:
                        segment.close()  # unmap what this attempt mapped; the old segments stay
                raise
        finally:
            if mine is not None:
                mine.unlink()  # every peer has mapped it (or the job is failing): leave nothing in /dev/shm
        self._slot_views.clear()  # views into the old mappings: drop them before those close
        for old in self._segments:
            old.close()
        self._segments = segments
        self._epoch = 0
        return want >= nbytes

    def _no_progress(self, missing_keys: list[str], what: str) -> PeerFailureError:
        """The failure to raise when ranks (their store keys end in the rank) did not ``what`` in time:
        a timeout, so the guard works out which rank is really hung before it names one."""
        ranks = sorted(int(key.rsplit("/", 1)[1]) for key in missing_keys)
        return PeerFailureError(
            f"no progress from rank {ranks[0]} for {self.timeout:.0f} s: it did not {what} "
            f"(ranks {ranks} missing; they may be hung or stuck outside the collective; "
            "see HORA_TRANSPORT_TIMEOUT)", ranks[0], timed_out=True)

    def allocate(self, nbytes: int) -> np.ndarray:
        """A byte buffer in this rank's segment (collective), so allreduce on it copies nothing in.

        Every call may return the same memory: use one buffer at a time. Falls back to ordinary
        memory when the request exceeds the segment limit.
        """
        self._check_open("allocate")
        with self._guard("allocate"):
            if self.size > 1 and self._ensure(nbytes):
                return self._own.data[:nbytes]
        return np.empty(nbytes, dtype=np.uint8)

    # ---- synchronisation ----------------------------------------------------------------------

    def _arrive(self, offset: int = 0) -> None:
        self._epoch += 1
        own = self._own.ctrl
        own[_OFFSET] = offset
        own[_EPOCH] = self._epoch  # written last: x86 keeps stores in order

    def _wait_all(self, target: int | None = None) -> None:
        """Wait until every peer has arrived at epoch ``target`` (default: this rank's latest)."""
        if target is None:
            target = self._epoch
        deadline = time.monotonic() + self.timeout
        next_liveness = time.monotonic() + _LIVENESS_EVERY_S
        for member, segment in enumerate(self._segments):
            if member == self._rank:
                continue
            ctrl = segment.ctrl
            checks = 0
            spin = self._spin_checks
            waited_since = None
            while ctrl[_EPOCH] < target:
                if ctrl[_ABORT]:
                    raise PeerFailureError(
                        f"rank {self._members[member]} aborted the collective after a failure", self._members[member])
                checks += 1
                if checks < spin:
                    continue
                # Yield the GIL (this process's other threads keep working) and the CPU; only a long
                # wait (the peer is busy elsewhere) backs off to real sleeps.
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                    fine_timer_slack()
                    if spin > _SPIN_CHECKS_MIN:
                        self._spin_checks = max(_SPIN_CHECKS_MIN, spin >> 1)
                waited = now - waited_since
                # Past a short yield, sleep in growing steps (capped): the peer is still computing,
                # and spinning would steal the core this process's training thread needs.
                time.sleep(0 if waited < _YIELD_FOR_S else min(_MAX_NAP_S, max(50e-6, waited / 8)))
                if now >= next_liveness:
                    next_liveness = now + _LIVENESS_EVERY_S
                    self._check_alive(member)
                    if now >= deadline:
                        raise PeerFailureError(
                            f"no progress from rank {self._members[member]} for {self.timeout:.0f} s "
                            "(it may be hung or stuck outside the collective; see HORA_TRANSPORT_TIMEOUT)",
                            self._members[member], timed_out=True)
            if waited_since is None and checks and spin < self._spin_most:
                self._spin_checks = min(self._spin_most, spin << 1)  # the spin caught the peer

    def _check_alive(self, member: int) -> None:
        try:
            os.kill(self._pids[member], 0)
        except ProcessLookupError:
            raise PeerFailureError(
                f"rank {self._members[member]} (pid {self._pids[member]}) died", self._members[member]) from None
        except PermissionError:
            pass

    def _sync(self, offset: int = 0) -> None:
        self._arrive(offset)
        self._wait_all()

    def _peer_view(self, member: int, nbytes: int, dtype: DTypeLike) -> np.ndarray:
        segment = self._segments[member]
        offset = int(segment.ctrl[_OFFSET])
        return segment.data[offset : offset + nbytes].view(dtype)

    # ---- collectives --------------------------------------------------------------------------

    def allreduce(self, buf: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> None:
        self._check_open("allreduce")
        check_buffer(buf)
        check_op(op, buf.dtype)
        if self.size == 1 or buf.size == 0:
            return
        flat = buf.reshape(-1)
        with self._guard("allreduce", flat.dtype):
            if flat.nbytes <= SMALL_BYTES:
                self._allreduce_small(flat, op)
                return
            if self._own.owns(flat):
                self._allreduce_staged(flat, op, self._own.offset_of(flat), out=None)
                return
            fits = self._ensure(flat.nbytes)
            step = max(1, self._own.capacity // flat.itemsize) if not fits else flat.size
            for lo in range(0, flat.size, step):
                chunk = flat[lo : lo + step]
                self._own.data[: chunk.nbytes].view(flat.dtype)[...] = chunk
                self._allreduce_staged(self._own.data[: chunk.nbytes].view(flat.dtype), op, 0, out=chunk)

    def allreduce_into(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp = ReduceOp.SUM,
                       postscale: float = 1.0) -> None:
        """Out-of-place allreduce from a caller's own memory: ``dst`` receives the reduction of every
        rank's ``src`` (``dst`` may be ``src``: in place). Same bits as :meth:`allreduce`.

        One copy in and one copy out: each rank copies into its segment only the shares its peers
        reduce, reduces its own share reading its part straight from ``src``, and copies the
        finished shares into ``dst``. Large buffers go in pipelined chunks, so one rank's copy of
        chunk k+1 overlaps the other's reduction of chunk k. ``postscale`` (Average's division) is
        applied in the copy out, not in a pass of its own.
        """
        self._check_open("allreduce")
        check_buffer(src)
        check_op(op, src.dtype)
        if dst is not src:
            check_buffer(dst)
            if dst.dtype != src.dtype or dst.size != src.size:
                raise ValueError(f"rank {self.global_rank}: allreduce output must match the input "
                                 f"({dst.dtype}[{dst.size}] vs {src.dtype}[{src.size}])")
        sflat, dflat = src.reshape(-1), dst.reshape(-1)
        if self.size == 1 or sflat.size == 0:
            if dflat is not sflat and not np.shares_memory(dflat, sflat):
                dflat[...] = sflat
            scale_into(dflat, postscale, dflat)
            return
        with self._guard("allreduce", sflat.dtype):
            if sflat.nbytes <= SMALL_BYTES:
                self._allreduce_small(sflat, op, dflat)
                scale_into(dflat, postscale, dflat)
                return
            fits = self._ensure(sflat.nbytes)
            step = sflat.size if fits else max(1, self._own.capacity // sflat.itemsize)
            for lo in range(0, sflat.size, step):
                self._allreduce_pipelined(sflat[lo : lo + step], dflat[lo : lo + step], op, postscale)

    def _allreduce_pipelined(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp, postscale: float) -> None:
        """:meth:`allreduce_into` on a window that fits the segments (see there).

        Every rank owns the elements it owns in :meth:`_allreduce_staged` and reduces them as it does
        (own values first, then the others in rank order), in pieces, but
        read from ``src``, with the result left in this rank's segment for the peers to copy.
        Epochs: every rank arrives once after copying chunk k in and once after reducing it, in the
        same order, so waiting for a peer's epoch number waits for exactly that step.
        """
        ufunc = reduction_ufunc(op, src.dtype)
        n, me = self.size, self._rank
        itemsize = src.itemsize
        # Rank m owns the same elements as in one unchunked reduction (so every element is summed in
        # the same order); chunk k takes the k-th piece of every rank's share.
        bounds = split_offsets(src.size, n)
        piece = max(1, _PIPELINE_BYTES // (itemsize * n))
        longest = max(bounds[m + 1] - bounds[m] for m in range(n))
        chunks = max(1, -(-longest // piece))
        shares = [[(min(bounds[m] + k * piece, bounds[m + 1]), min(bounds[m] + (k + 1) * piece, bounds[m + 1]))
                   for m in range(n)] for k in range(chunks)]
        # A long pipeline keeps chunk k in ring slot k % ring of the segments (rank m's piece at
        # m * piece), not at its offset in the tensor: the few slots in use stay in cache, where a
        # tensor-sized window would stream every byte through memory twice more (in place at 64 MiB,
        # a third of the time). The ring takes less room than the window, which fits the segments.
        wraps = chunks > _PIPELINE_RING
        ring, slot_len = _PIPELINE_RING, piece * n
        span = ring * slot_len if wraps else src.size
        own = self._own.data[: span * itemsize].view(src.dtype)
        # peers[me] is never read (this rank's own share is in ``own`` and ``src``).
        peers = [own if m == me else seg.data[: span * itemsize].view(src.dtype)
                 for m, seg in enumerate(self._segments)]

        def at(k: int, m: int, lo: int, hi: int) -> slice:  # where chunk k's piece of rank m's share lies
            if not wraps:
                return slice(lo, hi)
            start = (k % ring) * slot_len + m * piece
            return slice(start, start + hi - lo)

        copied: list[int] = []  # this rank's epoch at "chunk k copied in": the same on every rank
        reduced: list[int] = []

        def copy_in(k: int) -> None:  # the shares the peers reduce; this rank's own stays in src
            for m, (lo, hi) in enumerate(shares[k]):
                if m != me and hi > lo:
                    own[at(k, m, lo, hi)] = src[lo:hi]
            self._arrive()
            copied.append(self._epoch)

        def reduce(k: int) -> None:
            self._wait_all(copied[k])  # every peer copied chunk k in
            lo, hi = shares[k][me]
            if hi > lo:
                where = at(k, me, lo, hi)
                out = own[where]
                first = True
                for m in range(n):
                    if m != me:
                        ufunc(src[lo:hi] if first else out, peers[m][where], out=out)
                        first = False
            self._arrive()
            reduced.append(self._epoch)

        def copy_out(k: int) -> None:
            self._wait_all(reduced[k])  # every share of chunk k is reduced
            for m, (lo, hi) in enumerate(shares[k]):
                if hi > lo:
                    scale_into((own if m == me else peers[m])[at(k, m, lo, hi)], postscale, dst[lo:hi])

        # Copy-in of chunk k+1 comes before the reduction of chunk k, so a fast rank's copy overlaps
        # a slow rank's reduction, and its copy-out of k-1 the peers' reductions of k.
        # The ring's slots need no wait of their own: a rank refills slot k % ring (for chunk k)
        # in copy_in(k), after its copy_out(k-3) waited for every rank's reduce(k-3), and in
        # reduce(k), after waiting for every rank's copy_in(k), which each ran after its own
        # copy_out(k-3). With ring >= 3, the reads of chunk k - ring (a peer's reduction of its
        # share, then its copy out) are over by then.
        copy_in(0)
        for k in range(len(shares)):
            if k + 1 < len(shares):
                copy_in(k + 1)
            reduce(k)
            if k > 0:
                copy_out(k - 1)
        copy_out(len(shares) - 1)
        self._sync(0)  # nobody reads the segments any more: they may be reused

    def _allreduce_small(self, flat: np.ndarray, op: ReduceOp, out: np.ndarray | None = None) -> None:
        """One synchronisation: stage into the slot of this epoch's parity, then every rank reduces
        all slots in rank order (so every rank computes the same bits).

        Alternating slots make this safe without a second barrier: a slot is written again two epochs
        later, and every rank has passed the epoch in between only after it finished reading.
        """
        ufunc = reduction_ufunc(op, flat.dtype)
        parity = (self._epoch + 1) % 2
        nbytes = flat.nbytes
        key = (parity, nbytes, flat.dtype)
        slots = self._slot_views.get(key)
        if slots is None:  # the same few sizes recur every step: make their views once
            if len(self._slot_views) > 256:
                self._slot_views.clear()
            slots = self._slot_views[key] = [seg.small[parity][:nbytes].view(flat.dtype) for seg in self._segments]
        slots[self._rank][...] = flat
        self._sync()
        if out is None:
            out = flat
        if self.size == 2:
            ufunc(slots[0], slots[1], out=out)
            return
        acc = slots[0].copy()
        for m in range(1, self.size):
            ufunc(acc, slots[m], out=acc)
        out[...] = acc

    def _allreduce_staged(self, staged: np.ndarray, op: ReduceOp, offset: int, out: np.ndarray | None) -> None:
        """Every rank's input is staged in its segment at ``offset``; reduce, then gather the shares.

        ``out`` None means the result belongs in ``staged`` itself (the zero-copy path).
        """
        ufunc = reduction_ufunc(op, staged.dtype)
        count, nbytes = staged.size, staged.nbytes
        bounds = split_offsets(count, self.size)
        self._sync(offset)  # everyone's input is in place
        views = [staged if m == self._rank else self._peer_view(m, nbytes, staged.dtype) for m in range(self.size)]
        lo, hi = bounds[self._rank], bounds[self._rank + 1]
        if hi > lo:
            mine = views[self._rank][lo:hi]
            for m in range(self.size):
                if m != self._rank:
                    ufunc(mine, views[m][lo:hi], out=mine)
        self._sync(offset)  # every share is reduced
        target = staged if out is None else out
        for m in range(self.size):
            a, b = bounds[m], bounds[m + 1]
            if b > a and (m != self._rank or out is not None):
                target[a:b] = views[m][a:b]
        self._sync(offset)  # nobody reads the segments any more: they may be reused

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self._check_open("broadcast")
        check_buffer(buf)
        check_root(root, self.size)
        if self.size == 1 or buf.size == 0:
            return
        flat = buf.reshape(-1).view(np.uint8)
        with self._guard("broadcast"):
            fits = self._ensure(flat.nbytes)
            step = flat.nbytes if fits else self._own.capacity
            for lo in range(0, flat.nbytes, step):
                chunk = flat[lo : lo + step]
                if self._rank == root:
                    self._own.data[: chunk.nbytes] = chunk
                self._sync(0)
                if self._rank != root:
                    chunk[...] = self._peer_view(root, chunk.nbytes, np.uint8)
                self._sync(0)

    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        self._check_open("allgather")
        check_buffer(send, "send buffer")
        check_buffer(recv, "receive buffer")
        counts = check_counts(counts, self.size, "counts")
        isz = send.itemsize
        if max(counts) * isz > self._max_bytes or self.size == 1:
            return self._via_mesh("allgather", self._mesh.allgather, send, recv, counts)
        if recv.dtype != send.dtype or send.size != counts[self._rank] or recv.size != sum(counts):
            return self._mesh.allgather(send, recv, counts)  # its checks raise the right error
        offsets = count_offsets(counts)
        rflat = recv.reshape(-1)
        with self._guard("allgather"):
            self._ensure(max(counts) * isz)
            mine = send.reshape(-1)
            self._own.data[: mine.nbytes].view(send.dtype)[...] = mine
            self._sync(0)
            for m in range(self.size):
                part = rflat[offsets[m] : offsets[m + 1]]
                part[...] = mine if m == self._rank else self._peer_view(m, part.nbytes, send.dtype)
            self._sync(0)

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                      op: ReduceOp = ReduceOp.SUM) -> None:
        self._check_open("reducescatter")
        check_buffer(send, "send buffer")
        check_buffer(recv, "receive buffer")
        check_op(op, send.dtype)
        counts = check_counts(counts, self.size, "counts")
        offsets = count_offsets(counts)
        if (self.size == 1 or send.nbytes > self._max_bytes or recv.dtype != send.dtype
                or send.size != offsets[-1] or recv.size != counts[self._rank]):
            return self._via_mesh("reducescatter", self._mesh.reducescatter, send, recv, counts, op)
        ufunc = reduction_ufunc(op, send.dtype)
        sflat, rflat = send.reshape(-1), recv.reshape(-1)
        with self._guard("reducescatter", send.dtype):
            self._ensure(send.nbytes)
            staged = self._own.data[: sflat.nbytes].view(sflat.dtype)
            staged[...] = sflat
            self._sync(0)
            lo, hi = offsets[self._rank], offsets[self._rank + 1]
            rflat[...] = staged[lo:hi]
            for m in range(self.size):
                if m != self._rank and hi > lo:
                    ufunc(rflat, self._peer_view(m, sflat.nbytes, sflat.dtype)[lo:hi], out=rflat)
            self._sync(0)

    def barrier(self) -> None:
        self._check_open("barrier")
        if self.size == 1:
            return
        with self._guard("barrier"):
            self._sync(0)

    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int]) -> None:
        self._check_open("alltoall")
        self._via_mesh("alltoall", self._mesh.alltoall, send, send_counts, recv, recv_counts)

    # ---- objects ------------------------------------------------------------------------------
    # The engine exchanges objects on every negotiation (an uncached or unnamed collective). Through
    # the small-message slots that costs one synchronisation, against a round of TCP messages and
    # sender-thread hand-offs on the mesh. Objects that pickle larger than a slot go over the mesh;
    # every rank sees every length after the synchronisation, so all of them take the same path.

    def _object_slot(self, member: int, parity: int) -> memoryview:
        key = ("object", member, parity)
        view = self._slot_views.get(key)
        if view is None:  # made once per mapping (remapping clears the views)
            view = self._slot_views[key] = self._segments[member].small[parity].data
        return view

    def _post_object(self, payload: bytes | BaseException | None) -> int:
        """Put ``payload`` into this rank's slot for the coming epoch (None: nothing to say; an
        exception: pickling failed here, and the peers are told so rather than left reading what the
        slot held before); returns the slot's parity. Alternating slots are safe for the reason given
        in :meth:`_allreduce_small`."""
        parity = (self._epoch + 1) % 2
        slot = self._object_slot(self._rank, parity)
        if isinstance(payload, bytes) and len(payload) <= _OBJECT_ROOM:
            slot[_OBJECT_HEADER : _OBJECT_HEADER + len(payload)] = payload
            _LENGTH.pack_into(slot, 0, len(payload))
        else:
            _LENGTH.pack_into(slot, 0, _UNPICKLABLE if isinstance(payload, BaseException) else _TOO_LARGE)
        return parity

    def _check_picklable(self, what: str, payload: bytes | BaseException | None,
                         posted: Sequence[tuple[int, int]]) -> None:
        """Every rank of the exchange fails alike when a poster ((member, length) in ``posted``) could
        not pickle its object: that rank with its own error, the others naming it."""
        if isinstance(payload, BaseException):
            raise payload
        bad = [self._members[m] for m, length in posted if length == _UNPICKLABLE]
        if bad:
            raise ValueError(f"rank {self.global_rank}: {what} failed: rank {bad[0]} could not pickle its object")

    @staticmethod
    def _pickled(obj: Any) -> bytes | BaseException:
        try:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # reported to every rank after the synchronisation
            return exc

    def _posted_length(self, member: int, parity: int) -> int:
        length: int = _LENGTH.unpack_from(self._object_slot(member, parity), 0)[0]
        return length

    def _read_object(self, member: int, parity: int, length: int) -> Any:
        return pickle.loads(self._object_slot(member, parity)[_OBJECT_HEADER : _OBJECT_HEADER + length])

    def _exchange_objects(self, obj: Any, readers: int | None, what: str) -> list[Any] | None:
        """Every rank posts ``obj``; the rank ``readers`` (None: every rank) reads all of them. None
        when some rank's object did not fit its slot (then the caller goes over the mesh)."""
        with self._guard(what):
            payload = self._pickled(obj)
            parity = self._post_object(payload)
            self._sync()
            n = self.size
            lengths = [self._posted_length(m, parity) for m in range(n)]
            if min(lengths) < 0:
                self._check_picklable(what, payload, list(enumerate(lengths)))
                return None
            if readers is not None and readers != self._rank:
                return []
            return [obj if m == self._rank else self._read_object(m, parity, lengths[m]) for m in range(n)]

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        self._check_open("gather_object")
        check_root(root, self.size)
        if self.size == 1:
            return [obj]
        out = self._exchange_objects(obj, root, "gather_object")
        if out is None:
            return self._via_mesh("gather_object", self._mesh.gather_object, obj, root)
        return out if self._rank == root else None

    def allgather_object(self, obj: Any) -> list[Any]:
        self._check_open("allgather_object")
        if self.size == 1:
            return [obj]
        out = self._exchange_objects(obj, None, "allgather_object")
        if out is None:
            return self._via_mesh("allgather_object", self._mesh.allgather_object, obj)
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_open("broadcast_object")
        check_root(root, self.size)
        if self.size == 1:
            return obj
        with self._guard("broadcast_object"):
            payload = self._pickled(obj) if self._rank == root else None
            parity = self._post_object(payload)
            self._sync()
            length = self._posted_length(root, parity)
            if length >= 0:
                return obj if self._rank == root else self._read_object(root, parity, length)
            self._check_picklable("broadcast_object", payload, [(root, length)])
        return self._via_mesh("broadcast_object", self._mesh.broadcast_object, obj, root)

    def close(self) -> None:
        self._guard.closed = True
        self._slot_views.clear()  # views into the mappings: drop them so the mappings really close
        for segment in self._segments:
            segment.close()
        self._segments = []
        self._mesh.close()
