"""From the engine's negotiated items to device collectives: what the executor calls for CUDA tensors.

A binding that routes a tensor to the device path (:func:`route`) submits a :class:`DeviceTensor` as
the request's buffer: it has the ``dtype`` and ``shape`` the signature needs, the device buffer, the
framework's stream to chain on, and an ``allocate`` callback that makes a framework tensor for a
result whose shape only negotiation tells (allgather, alltoall, reducescatter). :class:`DeviceExecutor`
runs a negotiated list of such items in order: the same order on every member, which is what NCCL
requires of its calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

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
    allocate: Allocate

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
    dtype = _dtype_of(tensor)
    return choose_path(kind_id, dtype, op, mode, nccl_ready, scaled)


def _dtype_of(tensor: Any) -> np.dtype:
    if hasattr(tensor, "__cuda_array_interface__"):
        return np.dtype(tensor.__cuda_array_interface__["typestr"])
    return describe(tensor).dtype  # DLPack: reads the header only


class DeviceExecutor:
    """Runs one process set's negotiated device items through NCCL."""

    def __init__(self, collectives: DeviceCollectives, table: CommunicatorTable, set_key: Any,
                 members: list[int], my_rank: int) -> None:
        self.ops = collectives
        self.table = table
        self.set_key = set_key
        self.members = members
        self.my_rank = my_rank

    def run(self, items: Sequence[Any], complete: Callable[[Any, Any], None]) -> None:
        """Enqueue ``items`` (engine items whose request buffers are :class:`DeviceTensor`) and
        complete each with its framework result; completion means "enqueued and chained", not "done"."""
        comm = self.table.get(self.set_key, self.members, self.my_rank)
        allreduces = [i for i in items if i.response.signature.kind == Kind.ALLREDUCE]
        first = items[0].request.buffer
        producer = first.stream if first.stream is not None else 0
        results: dict[int, Any] = {}

        def body() -> None:
            # allreduces with one op and scales fuse into one bucket list; the rest run in order
            by_reduction: dict[tuple, list[Any]] = {}
            for item in allreduces:
                sig = item.response.signature
                by_reduction.setdefault((sig.op, sig.prescale, sig.postscale), []).append(item)
            for (op, prescale, postscale), group in by_reduction.items():
                self.ops.allreduce(comm, [i.request.buffer.buffer for i in group], ReduceOp(op), prescale, postscale)
                for item in group:
                    results[id(item)] = item.request.buffer.tensor
            for item in items:
                if item.response.signature.kind != Kind.ALLREDUCE:
                    results[id(item)] = self._one(comm, item)

        self.ops.run(producer, first.stream, body)
        for item in items:
            complete(item, results[id(item)])

    def _one(self, comm: Any, item: Any) -> Any:
        sig, response, dev = item.response.signature, item.response, item.request.buffer
        row = sig.row_count
        if sig.kind == Kind.BROADCAST:
            self.ops.broadcast(comm, dev.buffer, self.members.index(sig.root))
            return dev.tensor
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
