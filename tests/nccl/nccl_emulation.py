"""NCCL and the CUDA runtime emulated in host memory, to run hora's whole device path on a CPU.

No GPU is present in CI, so the engine's device path (signature flag, negotiation, the executor's
hand-off, :class:`hora.nccl.context.DeviceContext`, communicators through the rendezvous,
:class:`hora.nccl.dispatch.DeviceExecutor`, :class:`hora.nccl.ops.DeviceCollectives`) is driven here
with results checked: "device pointers" are host addresses, CUDA copies are ``memmove``, and each
NCCL communicator is a real hora TCP communicator among the ranks that called ``ncclCommInitRank``
with the same unique id. NCCL's semantics are kept where hora relies on them: calls between
``group_start`` and ``group_end`` run as one unit (point-to-point sends and receives of a group pair
up as an alltoall), ``ncclRedOpCreatePreMulSum`` scales every input before the Sum, and ``recv`` may
equal ``send`` (in place).

:class:`HostCudaArray` is a CUDA array as CuPy presents one (``__cuda_array_interface__`` plus an
Array API namespace), backed by a NumPy array.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from types import SimpleNamespace
from typing import Any

import numpy as np

from hora.nccl.library import DataType, RedOp
from hora.transport.base import ReduceOp

_NP = {
    DataType.INT8: np.int8, DataType.UINT8: np.uint8, DataType.INT32: np.int32, DataType.UINT32: np.uint32,
    DataType.INT64: np.int64, DataType.UINT64: np.uint64, DataType.FLOAT16: np.float16,
    DataType.FLOAT32: np.float32, DataType.FLOAT64: np.float64,
}
_REDUCE = {RedOp.SUM: ReduceOp.SUM, RedOp.PROD: ReduceOp.PRODUCT, RedOp.MAX: ReduceOp.MAX, RedOp.MIN: ReduceOp.MIN}


def view(ptr: int, count: int, dtype: DataType) -> np.ndarray:
    """The ``count`` elements at host address ``ptr`` as a writeable NumPy array."""
    np_dtype = np.dtype(_NP[DataType(dtype)])
    if count == 0:
        return np.empty(0, np_dtype)
    raw = (ctypes.c_char * (count * np_dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=np_dtype)


class HostCudaArray:
    """A "CUDA" array in host memory, seen by hora only through ``__cuda_array_interface__``."""

    def __init__(self, data: Any, dtype: Any = None) -> None:
        self.host = np.ascontiguousarray(np.array(data, dtype=dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.host.shape

    @property
    def ndim(self) -> int:
        return self.host.ndim

    @property
    def dtype(self) -> np.dtype:
        return self.host.dtype

    @property
    def __cuda_array_interface__(self) -> dict:
        return dict(shape=self.host.shape, typestr=self.host.dtype.str, data=(self.host.ctypes.data, False),
                    strides=None, version=3, stream=None)

    def __array_namespace__(self) -> SimpleNamespace:
        return SimpleNamespace(empty=lambda shape, dtype: HostCudaArray(np.empty(shape, dtype=dtype)))


class HostCuda:
    """:class:`hora.nccl.cudart.CudaApi` in host memory: work runs at once, so events are always done."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._blocks: dict[int, np.ndarray] = {}
        self.devices_set: list[int] = []
        self.copies = 0

    def set_device(self, device: int) -> None:
        self.devices_set.append(device)

    def stream_create(self) -> int:
        return next(self._ids)

    def event_create(self) -> int:
        return next(self._ids)

    def event_record(self, event: int, stream: int) -> None:
        pass

    def stream_wait_event(self, stream: int, event: int) -> None:
        pass

    def event_synchronize(self, event: int) -> None:
        pass

    def malloc(self, nbytes: int) -> int:
        block = np.empty(max(nbytes, 1), np.uint8)
        self._blocks[block.ctypes.data] = block
        return block.ctypes.data

    def free(self, ptr: int) -> None:
        self._blocks.pop(ptr)

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self.copies += 1
        ctypes.memmove(dst, src, nbytes)

    def pointer_device(self, ptr: int) -> int:
        return 0


class LoopbackNccl:
    """NCCL's calls over hora TCP communicators, one per unique id (see the module docstring)."""

    def __init__(self) -> None:
        self._comms: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._ops: dict[int, float] = {}  # PreMulSum handles -> their scale
        self._group_depth = 0
        self._deferred: list[tuple] = []
        self.calls: list[str] = []

    # ---- communicators ---------------------------------------------------------------------------

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        from hora.rendezvous.client import RendezvousClient
        from hora.runner import identity
        from hora.transport import create_communicator

        me = identity.from_environment()
        store = RendezvousClient(me.rendezvous_addr, me.rendezvous_port, me.secret)
        comm = create_communicator("tcp", rank, list(range(nranks)), store, f"emunccl/{unique_id.hex()[:32]}",
                                   me.secret)
        handle = next(self._ids)
        self._comms[handle] = (comm, store)
        self.calls.append(f"init:{rank}/{nranks}")
        return handle

    def comm_destroy(self, comm: int) -> None:
        communicator, store = self._comms.pop(comm)
        communicator.close()
        store.close()
        self.calls.append("destroy")

    def comm_abort(self, comm: int) -> None:
        self.comm_destroy(comm)
        self.calls[-1] = "abort"

    # ---- groups ----------------------------------------------------------------------------------

    def group_start(self) -> None:
        self._group_depth += 1

    def group_end(self) -> None:
        self._group_depth -= 1
        if self._group_depth == 0:
            deferred, self._deferred = self._deferred, []
            self._run_group(deferred)

    def _call(self, *call: Any) -> None:
        self.calls.append(call[0])
        if self._group_depth:
            self._deferred.append(call)
        else:
            self._run_group([call])

    def _run_group(self, calls: list[tuple]) -> None:
        sends = [c for c in calls if c[0] == "send"]
        recvs = [c for c in calls if c[0] == "recv"]
        if sends or recvs:
            self._pairwise(sends, recvs)
        for call in calls:
            if call[0] not in ("send", "recv"):
                getattr(self, "_do_" + call[0])(*call[1:])

    # ---- reductions ------------------------------------------------------------------------------

    def premul_sum(self, scale: float, dtype: DataType, comm: int) -> int:
        handle = 1000 + next(self._ids)
        self._ops[handle] = scale
        return handle

    def op_destroy(self, op: int, comm: int) -> None:
        self._ops.pop(op)

    def _reduce_into(self, send: int, recv: int, count: int, dtype: DataType, op: int, comm: int) -> np.ndarray:
        """The reduction of every member's ``send`` (scaled first for a PreMulSum), in a new array."""
        communicator = self._comms[comm][0]
        data = view(send, count, dtype).copy()
        if op in self._ops:
            data *= data.dtype.type(self._ops[op])
            reduce_op = ReduceOp.SUM
        else:
            reduce_op = _REDUCE[RedOp(op)]
        communicator.allreduce(data, reduce_op)
        return data

    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        self._call("all_reduce", send, recv, count, dtype, op, comm)

    def _do_all_reduce(self, send, recv, count, dtype, op, comm):
        view(recv, count, dtype)[...] = self._reduce_into(send, recv, count, dtype, op, comm)

    def reduce(self, send, recv, count, dtype, op, root, comm, stream):
        self._call("reduce", send, recv, count, dtype, op, root, comm)

    def _do_reduce(self, send, recv, count, dtype, op, root, comm):
        result = self._reduce_into(send, recv, count, dtype, op, comm)
        if self._comms[comm][0].rank == root:
            view(recv, count, dtype)[...] = result

    def reduce_scatter(self, send, recv, count, dtype, op, comm, stream):
        self._call("reduce_scatter", send, recv, count, dtype, op, comm)

    def _do_reduce_scatter(self, send, recv, count, dtype, op, comm):
        communicator = self._comms[comm][0]
        result = self._reduce_into(send, recv, count * communicator.size, dtype, op, comm)
        me = communicator.rank
        view(recv, count, dtype)[...] = result[me * count:(me + 1) * count]

    # ---- data movement ---------------------------------------------------------------------------

    def all_gather(self, send, recv, count, dtype, comm, stream):
        self._call("all_gather", send, recv, count, dtype, comm)

    def _do_all_gather(self, send, recv, count, dtype, comm):
        communicator = self._comms[comm][0]
        mine = view(send, count, dtype).copy()
        communicator.allgather(mine, view(recv, count * communicator.size, dtype), [count] * communicator.size)

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        self._call("broadcast", send, recv, count, dtype, root, comm)

    def _do_broadcast(self, send, recv, count, dtype, root, comm):
        communicator = self._comms[comm][0]
        out = view(recv, count, dtype)
        if communicator.rank == root and send != recv:
            out[...] = view(send, count, dtype)
        communicator.broadcast(out, root)

    def send(self, buf, count, dtype, peer, comm, stream):
        self._call("send", buf, count, dtype, peer, comm)

    def recv(self, buf, count, dtype, peer, comm, stream):
        self._call("recv", buf, count, dtype, peer, comm)

    def _pairwise(self, sends: list[tuple], recvs: list[tuple]) -> None:
        """A group's sends and receives, as NCCL pairs them: one alltoall over the communicator."""
        comm = (sends or recvs)[0][-1]
        dtype = (sends or recvs)[0][3]
        communicator = self._comms[comm][0]
        send_counts = [0] * communicator.size
        recv_counts = [0] * communicator.size
        send_parts: dict[int, np.ndarray] = {}
        for _, buf, count, _, peer, _ in sends:
            send_counts[peer] = count
            send_parts[peer] = view(buf, count, dtype)
        recv_at: dict[int, tuple[int, int]] = {}
        for _, buf, count, _, peer, _ in recvs:
            recv_counts[peer] = count
            recv_at[peer] = (buf, count)
        np_dtype = _NP[DataType(dtype)]
        packed = np.concatenate([send_parts.get(p, np.empty(0, np_dtype)) for p in range(communicator.size)])
        received = np.empty(sum(recv_counts), np_dtype)
        communicator.alltoall(packed, send_counts, received, recv_counts)
        offset = 0
        for peer in range(communicator.size):
            if peer in recv_at:
                buf, count = recv_at[peer]
                view(buf, count, dtype)[...] = received[offset:offset + count]
            offset += recv_counts[peer]


def install() -> tuple[HostCuda, LoopbackNccl]:
    """Make this process's device path use the emulation (call before ``hora.init``)."""
    from hora.nccl import context

    cuda, nccl = HostCuda(), LoopbackNccl()
    context.set_backend(lambda: (cuda, nccl), "emulated NCCL in host memory (tests)")
    return cuda, nccl
