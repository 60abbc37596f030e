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

Work runs as it does on a GPU: asynchronously, in stream order. Each stream hora creates is a
thread that runs what was enqueued on it (copies, NCCL kernels, event records, waits on events), so
an event is ready only once its stream reaches it. An NCCL kernel whose peer is gone does what real
NCCL's does: it never finishes (it does not fail either: over NVLink or shared memory NCCL reports
nothing), so its stream, and every event behind it, waits until ``ncclCommAbort`` is called on that
communicator; then the kernel ends and the events behind it on its stream report a CUDA error (a
framework stream that waited on it just goes on, as with real NCCL, which leaves no CUDA error).
``LoopbackNccl.fault`` makes the next kernel of a rank kill its process (``"die"``, SIGKILL, as a
rank that crashes mid-collective) or never run (``"hang"``, a stuck GPU: the peers wait for it);
``LoopbackNccl.kernel_delay`` makes its kernels finish later than its peers' (a slower GPU).

:class:`HostCudaArray` is a CUDA array as CuPy presents one (``__cuda_array_interface__`` plus an
Array API namespace), backed by a NumPy array.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from hora.nccl.cudart import CudaError
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


class KernelAborted(Exception):
    """An emulated NCCL kernel ended by ``ncclCommAbort``: the work behind it reports an error."""


class _Event:
    """One recording of a CUDA event: ready once its stream reaches it."""

    __slots__ = ("ready", "error")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.error: str | None = None


class _Stream:
    """An emulated CUDA stream: one thread runs its work in order, as a GPU runs a stream's kernels."""

    def __init__(self, name: str) -> None:
        self._work: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.error: str | None = None  # set once a kernel on it was aborted: later events report it
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, work: Callable[[], None]) -> None:
        self._work.put(work)

    def _run(self) -> None:
        while True:
            work = self._work.get()
            try:
                work()
            except Exception as exc:  # an aborted kernel (or a bug): the stream goes on, in error
                self.error = f"{type(exc).__name__}: {exc}"


class HostCuda:
    """:class:`hora.nccl.cudart.CudaApi` in host memory.

    Streams made by ``stream_create`` (hora's) run their work on their own thread (see the module
    docstring). Any other stream (a framework's, or the legacy stream 0) stands for the caller's host
    code, already done when it enqueues anything: events recorded there are ready at once, and its
    waits on hora's events are not emulated (the tests' arrays come without a stream, so hora waits).
    """

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._blocks: dict[int, np.ndarray] = {}
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, _Event] = {}
        self.devices_set: list[int] = []
        self.copies = 0
        self.synchronized = 0  # event_synchronize calls (hora polls instead: they should find work done)

    def set_device(self, device: int) -> None:
        self.devices_set.append(device)

    def stream_create(self) -> int:
        handle = next(self._ids)
        self._streams[handle] = _Stream(f"emulated-cuda-stream-{handle}")
        return handle

    def enqueue(self, stream: int, work: Callable[[], None]) -> None:
        """Run ``work`` in ``stream``'s order: on its thread for hora's streams, now for any other."""
        target = self._streams.get(stream)
        if target is None:
            work()
        else:
            target.put(work)

    def event_create(self) -> int:
        handle = next(self._ids)
        event = self._events[handle] = _Event()
        event.ready.set()  # a never-recorded event counts as done, as in CUDA
        return handle

    def event_record(self, event: int, stream: int) -> None:
        recording = self._events[event] = _Event()
        target = self._streams.get(stream)

        def reach() -> None:
            recording.error = target.error if target is not None else None
            recording.ready.set()

        self.enqueue(stream, reach)

    def stream_wait_event(self, stream: int, event: int) -> None:
        if stream in self._streams:
            recording = self._events[event]
            self._streams[stream].put(recording.ready.wait)

    def event_synchronize(self, event: int) -> None:
        """Blocks until the event is ready, however long that takes (as ``cudaEventSynchronize`` does)."""
        self.synchronized += 1
        recording = self._events[event]
        recording.ready.wait()
        self._raise_error(recording)

    def event_query(self, event: int) -> bool:
        recording = self._events[event]
        if not recording.ready.is_set():
            return False
        self._raise_error(recording)
        return True

    @staticmethod
    def _raise_error(recording: _Event) -> None:
        if recording.error is not None:
            raise CudaError(f"cudaEventQuery failed: work before the event failed ({recording.error}) "
                            "(cudaError 719, emulated)")

    def malloc(self, nbytes: int) -> int:
        block = np.empty(max(nbytes, 1), np.uint8)
        self._blocks[block.ctypes.data] = block
        return block.ctypes.data

    def free(self, ptr: int) -> None:
        self._blocks.pop(ptr)

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self.copies += 1
        self.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def pointer_device(self, ptr: int) -> int:
        return 0


class _Comm:
    """One emulated communicator: a hora TCP communicator, and the abort flag its kernels watch."""

    def __init__(self, communicator: Any, store: Any) -> None:
        self.communicator = communicator
        self.store = store
        self.aborted = threading.Event()
        self.broken: str | None = None  # why a kernel could not finish (a peer is gone)
        self._running = 0
        self._idle = threading.Condition()

    @property
    def rank(self) -> int:
        return int(self.communicator.rank)

    @property
    def size(self) -> int:
        return int(self.communicator.size)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._idle:
            self._running += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)


#: What reducing calls carry once enqueued: the reduction and the PreMulSum scale (None: no scale).
Reduction = tuple[ReduceOp, "float | None"]


class LoopbackNccl:
    """NCCL's calls over hora TCP communicators, one per unique id (see the module docstring)."""

    def __init__(self, cuda: HostCuda | None = None) -> None:
        self._cuda = cuda  # None: kernels run at once, in the calling thread
        self._comms: dict[int, _Comm] = {}
        self._ids = itertools.count(1)
        self._ops: dict[int, float] = {}  # PreMulSum handles -> their scale
        self._group_depth = 0
        self._deferred: list[tuple] = []
        self.calls: list[str] = []
        #: "die" or "hang": what this rank's next kernel does instead of its collective (module docstring)
        self.fault: str | None = None
        #: kernels that met a failed peer and waited for ncclCommAbort: (call names, why)
        self.stuck: list[tuple[list[str], str]] = []
        #: seconds each kernel takes after its transfers (this rank's GPU is slower than its peers')
        self.kernel_delay = 0.0

    # ---- communicators ---------------------------------------------------------------------------

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        from hora.rendezvous.client import RendezvousClient
        from hora.transport import create_communicator
        from hora.workers import identity

        me = identity.from_environment()
        store = RendezvousClient(me.rendezvous_addr, me.rendezvous_port, me.secret)
        comm = create_communicator("tcp", rank, list(range(nranks)), store, f"emunccl/{unique_id.hex()[:32]}",
                                   me.secret)
        handle = next(self._ids)
        self._comms[handle] = _Comm(comm, store)
        self.calls.append(f"init:{rank}/{nranks}")
        return handle

    def comm_destroy(self, comm: int) -> None:
        """Waits for the communicator's kernels to finish, however long (as ``ncclCommDestroy`` does)."""
        state = self._comms.pop(comm)
        state.wait_idle(None)
        state.communicator.close()
        state.store.close()
        self.calls.append("destroy")

    def comm_abort(self, comm: int) -> None:
        """Ends the communicator's kernels, finished or not (``ncclCommAbort``)."""
        self.calls.append("abort")  # first: what the ended kernels release may look at the calls at once
        state = self._comms.pop(comm)
        state.aborted.set()
        state.communicator.close()  # shuts its sockets: a kernel blocked on a peer returns at once
        state.wait_idle(10.0)
        state.store.close()

    def comm_get_async_error(self, comm: int) -> int:
        """ncclSuccess: a kernel whose peer is gone spins without a word (NVLink, shared memory)."""
        return 0

    # ---- groups and kernels ----------------------------------------------------------------------

    def group_start(self) -> None:
        self._group_depth += 1

    def group_end(self) -> None:
        self._group_depth -= 1
        if self._group_depth == 0:
            deferred, self._deferred = self._deferred, []
            if deferred:
                self._launch(deferred)

    def _call(self, *call: Any) -> None:
        """Record an NCCL call; ``call`` is (name, stream, arguments..., comm)."""
        self.calls.append(call[0])
        if self._group_depth:
            self._deferred.append(call)
        else:
            self._launch([call])

    def _launch(self, calls: list[tuple]) -> None:
        """Enqueue one kernel for ``calls`` (a group's, or a lone call) on their stream."""
        stream, comm = calls[0][1], self._comms[calls[0][-1]]
        fault, self.fault = self.fault, None
        names = [call[0] for call in calls]
        work = [(call[0],) + call[2:] for call in calls]

        def kernel() -> None:
            with comm.running():
                if fault == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault != "hang" and not comm.aborted.is_set():
                    try:
                        self._run_group(comm, work)
                        time.sleep(self.kernel_delay)
                        return
                    except Exception as exc:  # a peer is gone: NCCL's kernel waits for it forever
                        comm.broken = f"{type(exc).__name__}: {exc}"
                        self.stuck.append((names, comm.broken))
                comm.aborted.wait()
            raise KernelAborted(f"ncclCommAbort ended {'+'.join(names)}" + (f" ({comm.broken})" if comm.broken else ""))

        if self._cuda is None:
            kernel()
        else:
            self._cuda.enqueue(stream, kernel)

    def _run_group(self, comm: _Comm, calls: list[tuple]) -> None:
        sends = [c for c in calls if c[0] == "send"]
        recvs = [c for c in calls if c[0] == "recv"]
        if sends or recvs:
            self._pairwise(comm, sends, recvs)
        for call in calls:
            if call[0] not in ("send", "recv"):
                getattr(self, "_do_" + call[0])(comm, *call[1:-1])

    # ---- reductions ------------------------------------------------------------------------------

    def premul_sum(self, scale: float, dtype: DataType, comm: int) -> int:
        handle = 1000 + next(self._ids)
        self._ops[handle] = scale
        return handle

    def op_destroy(self, op: int, comm: int) -> None:
        self._ops.pop(op)

    def _reduction(self, op: int) -> Reduction:
        """The op as a kernel applies it, read when the call is enqueued (NCCL allows destroying a
        PreMulSum op right after)."""
        if op in self._ops:
            return ReduceOp.SUM, self._ops[op]
        return _REDUCE[RedOp(op)], None

    @staticmethod
    def _reduce_into(comm: _Comm, send: int, count: int, dtype: DataType, op: Reduction) -> np.ndarray:
        """The reduction of every member's ``send`` (scaled first for a PreMulSum), in a new array."""
        data = view(send, count, dtype).copy()
        reduce_op, scale = op
        if scale is not None:
            data *= data.dtype.type(scale)
        comm.communicator.allreduce(data, reduce_op)
        return data

    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        self._call("all_reduce", stream, send, recv, count, dtype, self._reduction(op), comm)

    def _do_all_reduce(self, comm, send, recv, count, dtype, op):
        view(recv, count, dtype)[...] = self._reduce_into(comm, send, count, dtype, op)

    def reduce(self, send, recv, count, dtype, op, root, comm, stream):
        self._call("reduce", stream, send, recv, count, dtype, self._reduction(op), root, comm)

    def _do_reduce(self, comm, send, recv, count, dtype, op, root):
        result = self._reduce_into(comm, send, count, dtype, op)
        if comm.rank == root:
            view(recv, count, dtype)[...] = result

    def reduce_scatter(self, send, recv, count, dtype, op, comm, stream):
        self._call("reduce_scatter", stream, send, recv, count, dtype, self._reduction(op), comm)

    def _do_reduce_scatter(self, comm, send, recv, count, dtype, op):
        result = self._reduce_into(comm, send, count * comm.size, dtype, op)
        me = comm.rank
        view(recv, count, dtype)[...] = result[me * count:(me + 1) * count]

    # ---- data movement ---------------------------------------------------------------------------

    def all_gather(self, send, recv, count, dtype, comm, stream):
        self._call("all_gather", stream, send, recv, count, dtype, comm)

    def _do_all_gather(self, comm, send, recv, count, dtype):
        mine = view(send, count, dtype).copy()
        comm.communicator.allgather(mine, view(recv, count * comm.size, dtype), [count] * comm.size)

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        self._call("broadcast", stream, send, recv, count, dtype, root, comm)

    def _do_broadcast(self, comm, send, recv, count, dtype, root):
        out = view(recv, count, dtype)
        if comm.rank == root and send != recv:
            out[...] = view(send, count, dtype)
        comm.communicator.broadcast(out, root)

    def send(self, buf, count, dtype, peer, comm, stream):
        self._call("send", stream, buf, count, dtype, peer, comm)

    def recv(self, buf, count, dtype, peer, comm, stream):
        self._call("recv", stream, buf, count, dtype, peer, comm)

    @staticmethod
    def _pairwise(comm: _Comm, sends: list[tuple], recvs: list[tuple]) -> None:
        """A group's sends and receives, as NCCL pairs them: one alltoall over the communicator."""
        dtype = (sends or recvs)[0][3]
        size = comm.size
        send_counts = [0] * size
        recv_counts = [0] * size
        send_parts: dict[int, np.ndarray] = {}
        for _, buf, count, _, peer, _ in sends:
            send_counts[peer] = count
            send_parts[peer] = view(buf, count, dtype)
        recv_at: dict[int, tuple[int, int]] = {}
        for _, buf, count, _, peer, _ in recvs:
            recv_counts[peer] = count
            recv_at[peer] = (buf, count)
        np_dtype = _NP[DataType(dtype)]
        packed = np.concatenate([send_parts.get(p, np.empty(0, np_dtype)) for p in range(size)])
        received = np.empty(sum(recv_counts), np_dtype)
        comm.communicator.alltoall(packed, send_counts, received, recv_counts)
        offset = 0
        for peer in range(size):
            if peer in recv_at:
                buf, count = recv_at[peer]
                view(buf, count, dtype)[...] = received[offset:offset + count]
            offset += recv_counts[peer]


def install() -> tuple[HostCuda, LoopbackNccl]:
    """Make this process's device path use the emulation (call before ``hora.init``)."""
    from hora.nccl import context

    cuda = HostCuda()
    nccl = LoopbackNccl(cuda)
    context.set_backend(lambda: (cuda, nccl), "emulated NCCL in host memory (tests)")
    return cuda, nccl
