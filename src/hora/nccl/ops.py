"""The device collectives: NCCL calls on hora's CUDA stream, ordered after the framework's with events.

Ordering, with no host wait: an event recorded on the producer's (framework's) stream is waited
for by hora's stream before any copy or NCCL call; after the last call an event recorded on hora's
stream is waited for by the consumer's stream, so whatever the framework enqueues next sees the
result. The caller gets that "done" event; for a framework without a stream handle (TensorFlow, JAX)
hora hands the tensor back only once that event is done.

Allreduce of many small tensors packs them into one device fusion buffer (:mod:`hora.nccl.fusion`);
scaling (prescale, postscale, Average's 1/size) runs inside NCCL as one pre-multiplied Sum, so hora
launches no kernel of its own. Alltoall and uneven allgather/reducescatter are grouped point-to-point,
broadcast and reduce calls in one ``ncclGroupStart``/``ncclGroupEnd``.

Every wait hora itself makes on the GPU ends (:meth:`DeviceCollectives.wait`): it polls
``cudaEventQuery`` with a deadline instead of blocking in ``cudaEventSynchronize``, because an NCCL
kernel whose peer died spins until its communicator is aborted, and only code that is not stuck in
that wait can abort it. The deadline is the stall limit (``stall_shutdown_time_seconds``, see
:func:`hora.nccl.context.stall_limit`); a wait also ends as soon as the device side was aborted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from hora.errors import HorovodInternalError
from hora.nccl import fusion
from hora.nccl.communicators import DeviceComm
from hora.nccl.cudart import DEVICE_TO_DEVICE, DEVICE_TO_HOST, HOST_TO_DEVICE, CudaApi, CudaError
from hora.nccl.library import DataType, nccl_dtype, nccl_op
from hora.transport.base import ReduceOp

#: Seconds hora's waits on the GPU may last when no limit is given (the transport timeout's default).
DEFAULT_STALL_LIMIT = 30.0
#: The longest pause between two polls of an event: short next to a collective, long next to a poll.
_MAX_POLL_PAUSE_S = 1e-3


class NcclCalls(Protocol):
    """The NCCL calls the collectives make (:class:`hora.nccl.library.Nccl`)."""

    def group_start(self) -> None: ...
    def group_end(self) -> None: ...
    def premul_sum(self, scale: float, dtype: DataType, comm: int) -> int: ...
    def op_destroy(self, op: int, comm: int) -> None: ...
    def all_reduce(self, send: int, recv: int, count: int, dtype: DataType, op: int, comm: int,
                   stream: int) -> None: ...
    def reduce_scatter(self, send: int, recv: int, count: int, dtype: DataType, op: int, comm: int,
                       stream: int) -> None: ...
    def reduce(self, send: int, recv: int, count: int, dtype: DataType, op: int, root: int, comm: int,
               stream: int) -> None: ...
    def all_gather(self, send: int, recv: int, count: int, dtype: DataType, comm: int, stream: int) -> None: ...
    def broadcast(self, send: int, recv: int, count: int, dtype: DataType, root: int, comm: int,
                  stream: int) -> None: ...
    def send(self, buf: int, count: int, dtype: DataType, peer: int, comm: int, stream: int) -> None: ...
    def recv(self, buf: int, count: int, dtype: DataType, peer: int, comm: int, stream: int) -> None: ...


class Tensor(Protocol):
    """What a collective needs of a tensor (:class:`hora.nccl.device_tensor.DeviceBuffer` has it)."""

    @property
    def ptr(self) -> int: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def count(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


def combined_scale(op: ReduceOp, prescale: float, postscale: float, size: int) -> float:
    """The one factor a Sum-based reduction multiplies by: prescale x postscale (x 1/size for Average)."""
    factor = float(prescale) * float(postscale)
    if ReduceOp(op) == ReduceOp.AVERAGE:
        factor /= size
    return factor


class DeviceCollectives:
    """Collectives on one GPU; one instance per process, shared by all its communicators."""

    def __init__(self, cuda: CudaApi, nccl: NcclCalls, fusion_threshold: int = 128 * 1024 * 1024,
                 stall_limit: float = DEFAULT_STALL_LIMIT, who: str = "this rank") -> None:
        self.cuda = cuda
        self.nccl = nccl
        self.stream = cuda.stream_create()
        self.fusion_threshold = fusion_threshold
        #: Seconds one of hora's waits on the GPU may last before it fails (see :meth:`wait`).
        self.stall_limit = stall_limit
        #: "rank 3 on host-a": names this process in the errors of its waits.
        self.who = who
        #: Why the device side was aborted (None: it was not); set from any thread, ends every wait.
        self.failure: str | None = None
        self._fusion_ptr = 0
        self._fusion_bytes = 0
        self._free_events: list[int] = []

    # ---- ordering ------------------------------------------------------------------------------

    def _event(self) -> int:
        """An event to record: a recycled one when there is one. A training step makes several,
        so creating one per use (and never destroying it) would grow the driver's tables forever."""
        return self._free_events.pop() if self._free_events else self.cuda.event_create()

    def recycle(self, *events: int) -> None:
        """Hand back events nothing will wait on or query again: every wait that names them is
        already enqueued (a stream wait takes the event's state at the call) or they are done."""
        self._free_events.extend(events)

    def after(self, producer_stream: int) -> None:
        """Make hora's stream wait for everything the producer enqueued so far (no host wait)."""
        event = self._event()
        self.cuda.event_record(event, producer_stream)
        self.cuda.stream_wait_event(self.stream, event)
        self.recycle(event)

    def before(self, consumer_stream: int | None) -> int:
        """Record "done" on hora's stream; make ``consumer_stream`` (if any) wait for it. Returns the
        event, which the caller recycles once it no longer watches it."""
        event = self._event()
        self.cuda.event_record(event, self.stream)
        if consumer_stream is not None:
            self.cuda.stream_wait_event(consumer_stream, event)
        return event

    def mark(self) -> int:
        """An event recorded on hora's stream now: done once the GPU reaches this point (a run's
        start marker, from which its stall clock runs). The caller recycles it."""
        event = self._event()
        self.cuda.event_record(event, self.stream)
        return event

    # ---- waiting, with an end ------------------------------------------------------------------

    def done(self, event: int) -> bool:
        """Whether the work before ``event`` is done, without waiting. A CUDA error of that work is a
        :class:`HorovodInternalError` (the collective failed; elastic training may re-form)."""
        try:
            return self.cuda.event_query(event)
        except CudaError as exc:
            raise HorovodInternalError(f"{self.who}: NCCL work on hora's CUDA stream failed: {exc}") from exc

    def wait(self, event: int, what: str) -> None:
        """Wait on the host until ``event`` is done; raise :class:`HorovodInternalError` naming
        ``what`` once the device side was aborted or after :attr:`stall_limit` seconds.

        Polled rather than blocked in ``cudaEventSynchronize``: a dead peer's collective never
        finishes, so a blocking wait would never return to anything that could abort it.
        """
        deadline = time.monotonic() + self.stall_limit
        pause = 0.0
        while not self.done(event):
            if self.failure is not None:
                raise HorovodInternalError(f"{self.who}: {what} ended: the NCCL path was aborted ({self.failure})")
            if time.monotonic() >= deadline:
                raise HorovodInternalError(
                    f"{self.who}: {what}: hora's CUDA stream did not finish its work within {self.stall_limit:g} s "
                    "(HORA_STALL_SHUTDOWN_TIME_SECONDS, or HORA_TRANSPORT_TIMEOUT when that is 0); an NCCL "
                    "collective's peer is gone or hung")
            time.sleep(pause)
            pause = min(max(2 * pause, 10e-6), _MAX_POLL_PAUSE_S)
        self.cuda.event_synchronize(event)  # done: returns at once, and reports the work's error if any

    def drain(self) -> None:
        """Wait (with :meth:`wait`'s end) until hora's stream has done everything enqueued on it."""
        self._wait_for_stream("waiting for hora's CUDA stream to drain")

    def _wait_for_stream(self, what: str) -> None:
        event = self.before(None)
        self.wait(event, what)
        self.recycle(event)

    def fusion_buffer(self, nbytes: int) -> int:
        """The device fusion buffer, grown (never shrunk) to ``nbytes``; reused by every bucket."""
        if nbytes > self._fusion_bytes:
            if self._fusion_ptr:
                # the old buffer may still be in use by enqueued work: free only after hora's stream drains
                self.drain()
                self.cuda.free(self._fusion_ptr)
            self._fusion_ptr = self.cuda.malloc(nbytes)
            self._fusion_bytes = nbytes
        return self._fusion_ptr

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """``src`` into ``dst`` (same size), on hora's stream."""
        if src.nbytes:
            self.cuda.memcpy_async(dst.ptr, src.ptr, src.nbytes, DEVICE_TO_DEVICE, self.stream)

    def close(self) -> None:
        """Free the fusion buffer once hora's stream has drained (raises, keeping it, if it does not)."""
        if self._fusion_ptr:
            self.drain()
            self.cuda.free(self._fusion_ptr)
            self._fusion_ptr, self._fusion_bytes = 0, 0

    # ---- reductions ----------------------------------------------------------------------------

    def _reduction(self, op: ReduceOp, factor: float, dtype: DataType, comm: int) -> tuple[int, bool]:
        """The NCCL op for ``op`` scaled by ``factor``, and whether it was created (and must be destroyed)."""
        base = ReduceOp.SUM if ReduceOp(op) == ReduceOp.AVERAGE else ReduceOp(op)
        if factor == 1.0:
            return int(nccl_op(base)), False
        if base != ReduceOp.SUM:
            raise ValueError(f"prescale/postscale with {base.name} cannot run inside NCCL; such tensors take "
                             "the host path")
        return self.nccl.premul_sum(factor, dtype, comm), True

    def allreduce(self, comm: DeviceComm, tensors: Sequence[Tensor], op: ReduceOp, prescale: float = 1.0,
                  postscale: float = 1.0) -> None:
        """Reduce ``tensors`` in place across ``comm`` (fused where small), on hora's stream."""
        factor = combined_scale(op, prescale, postscale, comm.size)
        buckets = fusion.plan([(np.dtype(t.dtype).name, t.nbytes) for t in tensors], self.fusion_threshold)
        if any(b.fused for b in buckets):
            self.fusion_buffer(fusion.buffer_bytes(buckets))
        for bucket in buckets:
            dtype = nccl_dtype(tensors[bucket.slots[0].index].dtype)
            red, created = self._reduction(op, factor, dtype, comm.comm)
            if not bucket.fused:
                t = tensors[bucket.slots[0].index]
                self.nccl.all_reduce(t.ptr, t.ptr, t.count, dtype, red, comm.comm, self.stream)
            else:
                itemsize = np.dtype(tensors[bucket.slots[0].index].dtype).itemsize
                for slot in bucket.slots:
                    self.cuda.memcpy_async(self._fusion_ptr + slot.offset, tensors[slot.index].ptr, slot.nbytes,
                                           DEVICE_TO_DEVICE, self.stream)
                # the aligned gaps between slots are reduced too (harmless), so one launch covers the bucket
                count = bucket.nbytes // itemsize
                self.nccl.all_reduce(self._fusion_ptr, self._fusion_ptr, count, dtype, red, comm.comm, self.stream)
                for slot in bucket.slots:
                    self.cuda.memcpy_async(tensors[slot.index].ptr, self._fusion_ptr + slot.offset, slot.nbytes,
                                           DEVICE_TO_DEVICE, self.stream)
            if created:
                self.nccl.op_destroy(red, comm.comm)  # allowed once the call is enqueued

    def hierarchical_allreduce(self, local: DeviceComm, tensor: Tensor, op: ReduceOp,
                               cross_allreduce: Callable[[np.ndarray], None], prescale: float = 1.0,
                               postscale: float = 1.0, world_size: int = 1) -> None:
        """NCCL inside the host, hora's ring across hosts (Horovod's hierarchical allreduce with NCCL).

        The host's GPUs reduce to local rank 0 (``ncclReduce``, scaled once); local rank 0 copies the
        host's sum to host memory, ``cross_allreduce`` combines it with the other hosts' (hora's
        CPU transport among the local-rank-0 processes), and the result is broadcast back inside
        the host (``ncclBroadcast``). Only that copy waits on the host, and only on hora's stream.
        """
        dtype = nccl_dtype(tensor.dtype)
        factor = combined_scale(op, prescale, postscale, world_size)
        red, created = self._reduction(op, factor, dtype, local.comm)
        self.nccl.reduce(tensor.ptr, tensor.ptr, tensor.count, dtype, red, 0, local.comm, self.stream)
        if created:
            self.nccl.op_destroy(red, local.comm)
        if local.rank == 0:
            host = np.empty(tensor.count, dtype=tensor.dtype)
            self.cuda.memcpy_async(host.ctypes.data, tensor.ptr, tensor.nbytes, DEVICE_TO_HOST, self.stream)
            self._wait_for_stream("copying the host's sum to host memory")
            cross_allreduce(host)
            self.cuda.memcpy_async(tensor.ptr, host.ctypes.data, tensor.nbytes, HOST_TO_DEVICE, self.stream)
            self._wait_for_stream("copying the hosts' sum back")  # ``host`` must outlive the copy
        self.nccl.broadcast(tensor.ptr, tensor.ptr, tensor.count, dtype, 0, local.comm, self.stream)

    def reducescatter(self, comm: DeviceComm, tensor: Tensor, output: Tensor, counts: Sequence[int],
                      op: ReduceOp, prescale: float = 1.0, postscale: float = 1.0) -> None:
        """Member ``r`` gets the reduction of elements ``counts[:r]`` .. ``counts[:r+1]`` in ``output``."""
        dtype = nccl_dtype(tensor.dtype)
        red, created = self._reduction(op, combined_scale(op, prescale, postscale, comm.size), dtype, comm.comm)
        if len(set(counts)) == 1:
            self.nccl.reduce_scatter(tensor.ptr, output.ptr, counts[0], dtype, red, comm.comm, self.stream)
        else:
            itemsize = np.dtype(tensor.dtype).itemsize
            self.nccl.group_start()
            offset = 0
            for root, count in enumerate(counts):
                self.nccl.reduce(tensor.ptr + offset * itemsize, output.ptr, count, dtype, red, root, comm.comm,
                                 self.stream)
                offset += count
            self.nccl.group_end()
        if created:
            self.nccl.op_destroy(red, comm.comm)

    # ---- data movement -------------------------------------------------------------------------

    def allgather(self, comm: DeviceComm, tensor: Tensor, output: Tensor, counts: Sequence[int]) -> None:
        """Concatenate every member's ``counts[r]`` elements into ``output``, in member order."""
        dtype = nccl_dtype(tensor.dtype)
        if len(set(counts)) == 1:
            self.nccl.all_gather(tensor.ptr, output.ptr, counts[0], dtype, comm.comm, self.stream)
            return
        itemsize = np.dtype(tensor.dtype).itemsize
        self.nccl.group_start()
        offset = 0
        for root, count in enumerate(counts):
            send = tensor.ptr if root == comm.rank else output.ptr + offset * itemsize
            self.nccl.broadcast(send, output.ptr + offset * itemsize, count, dtype, root, comm.comm, self.stream)
            offset += count
        self.nccl.group_end()

    def broadcast(self, comm: DeviceComm, tensor: Tensor, root: int) -> None:
        """``root``'s (set rank) elements into every member's ``tensor``, in place."""
        self.nccl.broadcast(tensor.ptr, tensor.ptr, tensor.count, nccl_dtype(tensor.dtype), root, comm.comm,
                            self.stream)

    def alltoall(self, comm: DeviceComm, tensor: Tensor, send_counts: Sequence[int], output: Tensor,
                 recv_counts: Sequence[int]) -> None:
        """Send ``send_counts[r]`` elements to member ``r`` and receive ``recv_counts[r]`` from it."""
        dtype = nccl_dtype(tensor.dtype)
        itemsize = np.dtype(tensor.dtype).itemsize
        self.nccl.group_start()
        send_off = recv_off = 0
        for peer in range(comm.size):
            if send_counts[peer]:
                self.nccl.send(tensor.ptr + send_off * itemsize, send_counts[peer], dtype, peer, comm.comm, self.stream)
            if recv_counts[peer]:
                self.nccl.recv(output.ptr + recv_off * itemsize, recv_counts[peer], dtype, peer, comm.comm, self.stream)
            send_off += send_counts[peer]
            recv_off += recv_counts[peer]
        self.nccl.group_end()

    def grouped(self, calls: Sequence[Callable[[], None]]) -> None:
        """Run several collectives as one NCCL group (the grouped forms: one launch for the group)."""
        self.nccl.group_start()
        try:
            for call in calls:
                call()
        finally:
            self.nccl.group_end()

    def run(self, producer_stream: int, consumer_stream: int | None, body: Callable[[], None]) -> int:
        """``body``'s collectives ordered after ``producer_stream`` and before ``consumer_stream``.

        Returns the done event (the caller watches it until the GPU is there, and hands results
        back only then when the framework has no stream to chain on).
        """
        self.after(producer_stream)
        body()
        return self.before(consumer_stream)
