"""From the engine's negotiated items to device collectives: what the executor calls for CUDA tensors.

A binding that routes a tensor to the device path (:func:`route`) submits a :class:`DeviceTensor` as
the request's buffer: it has the ``dtype`` and ``shape`` the signature needs, the device buffer, the
framework's stream to chain on, and an ``allocate`` callback that makes a framework tensor for a
result whose shape only negotiation tells (allgather, alltoall, reducescatter). :class:`DeviceExecutor`
runs a negotiated list of such items in order: the same order on every member, which is what NCCL
requires of its calls.

Each run stays watched (:class:`InFlight`) until the GPU has done it. An item whose framework has a
stream completes at once (its stream waits for hora's), one without a stream completes only when
the run is done (:meth:`DeviceExecutor.poll`, every engine cycle); the engine goes on cycling
meanwhile, so a peer that dies is noticed by the host transport as on the CPU path. A run that has
been on the GPU longer than the stall limit fails (a dead or hung peer's NCCL kernel never finishes),
and the caller aborts the communicators (:meth:`hora.nccl.context.DeviceContext.abort`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hora.engine.executor import reducescatter_blocks
from hora.engine.request import Kind
from hora.errors import HorovodInternalError
from hora.nccl.communicators import CommunicatorTable
from hora.nccl.device_tensor import DeviceBuffer, describe, device_of
from hora.nccl.ops import DeviceCollectives
from hora.nccl.path import PathChoice, choose_path
from hora.transport.base import ReduceOp

#: ``allocate(shape)`` -> (framework tensor, its device buffer) on the input's device and dtype.
Allocate = Callable[[tuple[int, ...]], tuple[Any, DeviceBuffer]]
#: How long a run of stream-less items is polled right after enqueue before its completion is left to
#: the next cycles: a short collective is then handed back without waiting a cycle time.
_SPIN_S = 1e-3


@dataclass
class DeviceTensor:
    """A CUDA tensor on the device path, as an engine request carries it."""

    tensor: Any
    buffer: DeviceBuffer
    stream: int | None  # the framework's current stream (None: it has none to chain on)
    allocate: Allocate | None  # None: an in-place allreduce_/broadcast_ (no new tensor is made)
    #: allreduce/broadcast: whether the result overwrites ``tensor`` (``allreduce_``), or goes to a
    #: new tensor that hora fills on its own stream (``allreduce``)
    inplace: bool = True

    @property
    def dtype(self) -> np.dtype:
        return self.buffer.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.buffer.shape


def route(tensor: Any, op: ReduceOp | None, mode: str, nccl_ready: Callable[[], tuple[bool, str]],
          scaled: bool = False) -> PathChoice:
    """The path of any framework's tensor (reads only its device and dtype, never its data)."""
    kind_id = device_of(tensor)
    dtype = dtype_of(tensor)
    return choose_path(kind_id, dtype, op, mode, nccl_ready, scaled)


def dtype_of(tensor: Any) -> np.dtype:
    """A tensor's dtype from its CUDA array interface or DLPack header (never its data)."""
    if hasattr(tensor, "__cuda_array_interface__"):
        return np.dtype(tensor.__cuda_array_interface__["typestr"])
    return describe(tensor).dtype  # DLPack: reads the header only


@dataclass
class InFlight:
    """One run's work on hora's stream, watched from enqueue until the GPU has done it."""

    start: int  # event recorded on hora's stream before the run's first copy or NCCL call
    done: int  # event recorded after its last
    names: list[str]
    #: (item, result) of items whose framework has no stream: completed only once ``done``
    waiting: list[tuple[Any, Any]] = field(default_factory=list)
    started_at: float | None = None  # when a poll first saw ``start`` done: the run's stall clock


class DeviceExecutor:
    """Runs one process set's negotiated device items through NCCL."""

    def __init__(self, collectives: DeviceCollectives, table: CommunicatorTable, set_key: Any,
                 members: list[int], my_rank: int,
                 hierarchy: tuple[list[int], Callable[[np.ndarray], None]] | None = None) -> None:
        self.ops = collectives
        self.table = table
        self.set_key = set_key
        self.members = members
        self.my_rank = my_rank
        #: (this host's global ranks, the cross-host allreduce of host memory) under hierarchical
        #: allreduce across hosts: NCCL inside the host, hora's CPU transport among hosts
        self.hierarchy = hierarchy
        self._in_flight: deque[InFlight] = deque()  # in enqueue order, which is hora's stream's order
        self._waiting_items = 0

    def run(self, items: Sequence[Any], complete: Callable[[Any, Any], None]) -> None:
        """Enqueue ``items`` (engine items whose request buffers are :class:`DeviceTensor`) and
        complete each with its framework result.

        An item whose framework has a stream completes now: whatever the framework enqueues next on
        it waits for hora's done event. An item that came with no stream (a framework without one to
        chain on) completes once the GPU has done the run: here if that is soon, else from
        :meth:`poll`, so the engine is never stuck waiting on the GPU.
        """
        comm = self.table.get(self.set_key, self.members, self.my_rank)
        streams = list(dict.fromkeys(i.request.buffer.stream for i in items))
        results: dict[int, Any] = {}
        starts: list[int] = []

        def body() -> None:
            for stream in streams[1:]:  # ops.run orders after the first; the others join here
                self.ops.after(stream if stream is not None else 0)
            starts.append(self.ops.mark())
            # allreduces with one op and scales fuse into one bucket list; the rest run in order
            by_reduction: dict[tuple, list[Any]] = {}
            for item in items:
                if item.response.signature.kind == Kind.ALLREDUCE:
                    sig = item.response.signature
                    by_reduction.setdefault((sig.op, sig.prescale, sig.postscale), []).append(item)
            for (op, prescale, postscale), group in by_reduction.items():
                targets = [self._target(item) for item in group]
                for item, (_, result) in zip(group, targets):
                    results[id(item)] = result
                self._allreduce(comm, [buffer for buffer, _ in targets], ReduceOp(op), prescale, postscale)
            for item in items:
                if item.response.signature.kind != Kind.ALLREDUCE:
                    results[id(item)] = self._one(comm, item)

        first = streams[0]
        done = self.ops.run(first if first is not None else 0, None, body)
        for stream in streams:
            if stream is not None:
                self.ops.cuda.stream_wait_event(stream, done)
        work = InFlight(starts[0], done, [item.response.name for item in items])
        for item in items:
            if item.request.buffer.stream is None:
                work.waiting.append((item, results[id(item)]))
            else:
                complete(item, results[id(item)])
        self._in_flight.append(work)
        self._waiting_items += len(work.waiting)
        if work.waiting:
            self._spin(work)
            self.poll(complete)

    @property
    def waiting(self) -> bool:
        """Whether items handed to :meth:`run` still wait for the GPU before they complete."""
        return self._waiting_items > 0

    def poll(self, complete: Callable[[Any, Any], None], finish: bool = False) -> int:
        """Complete the items of runs the GPU has done (oldest first: hora's stream runs them in
        order); returns how many. Raises :class:`HorovodInternalError` when the oldest unfinished run
        cannot finish: it has been on the GPU past the stall limit, NCCL reports its communicator
        broken, or the device side was aborted. The caller then aborts the communicators.

        ``finish``: the job is shutting down, so wait (up to the stall limit) for every run that
        still has items to complete: its peers may have had theirs already, and called shutdown.
        """
        completed = 0
        while self._in_flight:
            work = self._in_flight[0]
            self._check_not_aborted()
            if finish and self._waiting_items:
                self.ops.wait(work.done, f"finishing NCCL work ({_names(work.names)}) before shutting down")
            elif not self.ops.done(work.done):
                self._watch(work)
                break
            self._in_flight.popleft()
            self.ops.recycle(work.start, work.done)
            self._waiting_items -= len(work.waiting)
            for item, result in work.waiting:
                complete(item, result)
            completed += len(work.waiting)
        return completed

    def _spin(self, work: InFlight) -> None:
        """Poll a just-enqueued run briefly (a short collective is done within a cycle time)."""
        deadline = time.monotonic() + _SPIN_S
        while not self.ops.done(work.done) and time.monotonic() < deadline:
            time.sleep(0)

    def _check_not_aborted(self) -> None:
        if self.ops.failure is not None:
            raise HorovodInternalError(f"{self.ops.who}: the NCCL path was aborted ({self.ops.failure})")

    def _watch(self, work: InFlight) -> None:
        """Raise if ``work`` (the oldest unfinished run) can no longer finish by itself."""
        broken = self.table.async_error()
        if broken is not None:
            raise HorovodInternalError(f"{self.ops.who}: {broken}; NCCL work of process set {self.set_key} "
                                       f"({_names(work.names)}) cannot finish")
        now = time.monotonic()
        if work.started_at is None:
            if self.ops.done(work.start):  # the GPU reached the run: its clock starts
                work.started_at = now
            return
        ran = now - work.started_at
        if ran > self.ops.stall_limit:
            raise HorovodInternalError(
                f"{self.ops.who}: NCCL work of process set {self.set_key} ({_names(work.names)}) has run on the "
                f"GPU for {ran:.0f} s without finishing (limit {self.ops.stall_limit:g} s: "
                "HORA_STALL_SHUTDOWN_TIME_SECONDS, or HORA_TRANSPORT_TIMEOUT when that is 0); a peer is gone or "
                "hung, so its NCCL kernels would spin forever")

    def _target(self, item: Any) -> tuple[DeviceBuffer, Any]:
        """The buffer an allreduce or broadcast works on and the framework tensor it returns: the
        input itself in place, else a new tensor filled from the input on hora's stream."""
        dev = item.request.buffer
        if dev.inplace:
            return dev.buffer, dev.tensor
        out, out_buf = dev.allocate(tuple(dev.shape))
        self.ops.copy(out_buf, dev.buffer)
        return out_buf, out

    def _allreduce(self, comm: Any, buffers: list[DeviceBuffer], op: ReduceOp, prescale: float,
                   postscale: float) -> None:
        if self.hierarchy is not None and op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            host_ranks, cross_allreduce = self.hierarchy
            local = self.table.get(("local", host_ranks[0]), host_ranks, self.my_rank)
            for buffer in buffers:
                self.ops.hierarchical_allreduce(local, buffer, op, cross_allreduce, prescale, postscale,
                                                world_size=comm.size)
            return
        self.ops.allreduce(comm, buffers, op, prescale, postscale)

    def _one(self, comm: Any, item: Any) -> Any:
        sig, response, dev = item.response.signature, item.response, item.request.buffer
        row = sig.row_count
        if sig.kind == Kind.BROADCAST:
            buffer, result = self._target(item)
            self.ops.broadcast(comm, buffer, self.members.index(sig.root))
            return result
        if sig.kind == Kind.ALLGATHER:
            out, out_buf = dev.allocate((sum(response.rows),) + tuple(sig.shape[1:]))
            self.ops.allgather(comm, dev.buffer, out_buf, [r * row for r in response.rows])
            return out
        if sig.kind == Kind.ALLTOALL:
            me = comm.rank
            send_rows = list(response.splits[me])
            recv_rows = [response.splits[m][me] for m in range(comm.size)]
            out, out_buf = dev.allocate((sum(recv_rows),) + tuple(sig.shape[1:]))
            self.ops.alltoall(comm, dev.buffer, [r * row for r in send_rows], out_buf, [r * row for r in recv_rows])
            return out, np.asarray(recv_rows, dtype=np.int64)
        if sig.kind == Kind.REDUCESCATTER:
            rows = reducescatter_blocks(sig, comm.size)
            out, out_buf = dev.allocate((rows[comm.rank],) + tuple(sig.shape[1:]))
            self.ops.reducescatter(comm, dev.buffer, out_buf, [r * row for r in rows], ReduceOp(sig.op),
                                   sig.prescale, sig.postscale)
            return out
        raise ValueError(f"{sig.kind.value} has no device form; the engine keeps it on the host path")


def _names(names: list[str], shown: int = 3) -> str:
    """``'a', 'b', 'c' and 4 more``: the tensors of a run, for an error message."""
    text = ", ".join(repr(n) for n in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")
