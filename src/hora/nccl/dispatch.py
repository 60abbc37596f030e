"""From the engine's negotiated items to device collectives: what the executor calls for CUDA tensors.

A binding that routes a tensor to the device path (:func:`route`) submits a :class:`DeviceTensor` as
the request's buffer: it has the ``dtype`` and ``shape`` the signature needs, the device buffer, the
framework's stream to chain on, and an ``allocate`` callback that makes a framework tensor for a
result whose shape only negotiation tells (allgather, alltoall, reducescatter). :class:`DeviceExecutor`
runs a negotiated list of such items in order: the same order on every member, which is what NCCL
requires of its calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hora.engine.executor import reducescatter_rows
from hora.engine.request import Kind
from hora.nccl.communicators import CommunicatorTable
from hora.nccl.device_tensor import DeviceBuffer, describe, device_of
from hora.nccl.ops import DeviceCollectives
from hora.nccl.path import PathChoice, choose_path
from hora.transport.base import ReduceOp

#: ``allocate(shape)`` -> (framework tensor, its device buffer) on the input's device and dtype.
Allocate = Callable[[tuple[int, ...]], tuple[Any, DeviceBuffer]]


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

    def run(self, items: Sequence[Any], complete: Callable[[Any, Any], None]) -> None:
        """Enqueue ``items`` (engine items whose request buffers are :class:`DeviceTensor`) and
        complete each with its framework result.

        Completion means "enqueued, and every framework stream the items came from waits for it":
        whatever the framework enqueues next on those streams sees the result. Items that came with
        no stream (a framework without one to chain on) are completed only once the GPU is done.
        """
        comm = self.table.get(self.set_key, self.members, self.my_rank)
        streams = list(dict.fromkeys(i.request.buffer.stream for i in items))
        results: dict[int, Any] = {}

        def body() -> None:
            for stream in streams[1:]:  # ops.run orders after the first; the others join here
                self.ops.after(stream if stream is not None else 0)
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
            if stream is None:
                self.ops.cuda.event_synchronize(done)
            else:
                self.ops.cuda.stream_wait_event(stream, done)
        for item in items:
            complete(item, results[id(item)])

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
            rows = reducescatter_rows(sig.shape[0] if sig.shape else 0, comm.size)
            out, out_buf = dev.allocate((rows[comm.rank],) + tuple(sig.shape[1:]))
            self.ops.reducescatter(comm, dev.buffer, out_buf, [r * row for r in rows], ReduceOp(sig.op),
                                   sig.prescale, sig.postscale)
            return out
        raise ValueError(f"{sig.kind.value} has no device form; the engine keeps it on the host path")
