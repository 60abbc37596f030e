"""Executes negotiated responses: plan fusion, pack, one transport call, unpack, complete handles.

Every member runs the same plan over the same ordered responses, so fused buffers line up byte for
byte across ranks. Requests of the same kind, dtype, op and scales are packed into one buffer up to
the fusion threshold; the members of a grouped collective always travel together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from hora.engine import adasum
from hora.engine.coordinator import Response
from hora.engine.request import Kind, Request, Signature
from hora.engine.timeline import Timeline
from hora.errors import CollectivePreconditionError
from hora.transport.base import Communicator, ReduceOp
from hora.transport.scaling import scale_into

# Enum members looked up once (attribute access on an Enum class is slow; these run per tensor or cycle).
_AVERAGE, _SUM, _ADASUM = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM

logger = logging.getLogger(__name__)

#: Buckets up to this size hand out their results as views of one new array (one allocation and one
#: copy for the whole bucket); larger ones give each result its own array, so that keeping one
#: result alive never keeps a large bucket's memory alive.
_SHARED_RESULT_BYTES = 1 << 20


class Item:
    """A response paired with this rank's request (None on a rank that has joined)."""

    __slots__ = ("response", "request", "from_cache")

    def __init__(self, response: Response, request: Request | None, from_cache: bool = False) -> None:
        self.response = response
        self.request = request
        self.from_cache = from_cache  # replayed from the response cache (already cached, as is)

    def __repr__(self) -> str:
        return f"Item({self.response.name!r}, from_cache={self.from_cache})"

    def own_request(self) -> Request:
        """The request, on a rank that has not joined (only allreduce runs on joined ranks)."""
        assert self.request is not None, f"{self!r} has no request: its rank has joined"
        return self.request


class DeviceRunner(Protocol):
    """Runs negotiated CUDA items through NCCL (:class:`hora.nccl.context.SetRunner`).

    ``run`` may leave items of a framework without a stream incomplete until the GPU has done
    them; ``poll`` (every cycle) completes those and raises HorovodInternalError for work that
    cannot finish (a dead or hung peer).
    """

    def run(self, items: list[Item], complete: Callable[[Item, Any], None]) -> None: ...
    def poll(self, complete: Callable[[Item, Any], None], finish: bool = False) -> int: ...
    @property
    def waiting(self) -> bool: ...


@dataclass
class Bucket:
    key: tuple[object, ...] | None  # None: a lone item, run without planning
    items: list[Item] = field(default_factory=list)
    nbytes: int = 0


def plan_buckets(items: list[Item], threshold: int) -> list[Bucket]:
    """Group items into fused buckets, deterministically (same input order -> same buckets).

    A bucket takes any later item with the same key while it stays within ``threshold`` bytes;
    a grouped collective's members are placed as one unit whatever their size (one unit per
    fusion key: members of different dtypes cannot share a buffer).
    """
    buckets: list[Bucket] = []
    open_by_key: dict[tuple[object, ...], Bucket] = {}
    units: list[list[Item]] = []
    group_units: dict[tuple[object, ...], list[Item]] = {}
    for item in items:
        response = item.response
        group = response.signature.group
        if group and response.error is None:
            unit_key = (group, response.fusion_key)
            unit = group_units.get(unit_key)
            if unit is None:
                unit = group_units[unit_key] = []
                units.append(unit)
            unit.append(item)
        else:
            units.append([item])
    for unit in units:
        key = unit[0].response.fusion_key
        size = unit[0].response.nbytes if len(unit) == 1 else sum(i.response.nbytes for i in unit)
        if key is None:
            buckets.append(Bucket(("single", len(buckets)), list(unit), size))
            continue
        bucket = open_by_key.get(key)
        if bucket is not None and threshold > 0 and bucket.nbytes + size <= threshold:
            bucket.items.extend(unit)
            bucket.nbytes += size
            continue
        bucket = Bucket(key, list(unit), size)
        buckets.append(bucket)
        if threshold > 0:
            open_by_key[key] = bucket
        else:
            open_by_key.pop(key, None)
    return buckets


def _is_average(sig: Signature) -> bool:
    return sig.op is _AVERAGE


def _transport_op(sig: Signature) -> ReduceOp:
    return _SUM if sig.op is _AVERAGE else sig.op


def _scale(buf: np.ndarray, factor: float) -> None:
    """Multiply ``buf`` by ``factor`` in place, with Horovod's rounding (see :func:`scale_into`)."""
    scale_into(buf, factor, buf)


def _postscale(sig: Signature, size: int) -> float:
    """The factor applied after the reduction: Average divides the postscale factor by the number
    of ranks (in float64, as Horovod does, not multiplied by a rounded 1/size)."""
    return sig.postscale / size if _is_average(sig) else sig.postscale


def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Rows of the first dimension each member receives: the first ``rows % size`` get one extra."""
    base, extra = divmod(rows, size)
    return [base + (1 if m < extra else 0) for m in range(size)]


def reducescatter_blocks(sig: Signature, size: int) -> list[int]:
    """Rows each member receives: the request's own ``splits`` where it names them (a hora addition
    that sharded gradients use, each member's block its own parameters), else Horovod's equal blocks."""
    return list(sig.splits) if sig.splits else reducescatter_rows(sig.shape[0] if sig.shape else 0, size)


class Executor:
    """Runs buckets on one communicator; ``member`` is this rank's index in it."""

    def __init__(self, comm: Communicator, members: list[int], threshold: int, timeline: Timeline | None) -> None:
        self.comm = comm
        self.members = members  # member index -> rank as hora.rank() numbers them
        self.threshold = threshold
        self.timeline = timeline
        self.activity = comm.activity
        self._fusion: dict[str, np.ndarray] = {}
        self._allocate = comm.allocate if comm.allocates_own_memory else None
        self._staged_min_bytes = comm.staged_min_bytes
        #: The transport's out-of-place allreduce (shared memory offers one), for lone tensors.
        self._into: Callable[[np.ndarray, np.ndarray, ReduceOp, float], None] | None = (
            comm.allreduce_into if comm.reduces_into else None)
        #: Called with a bucket's items just before their handles complete (the engine's bookkeeping
        #: must be done by then: a caller may resubmit the same name the moment its handle is done).
        self.before_complete: Callable[[list[Item]], None] = lambda items: None
        # (item, result or error, failed): handles of the running bucket, completed only once its
        # timeline events are written, so a stop_timeline() right after synchronize() loses none.
        self._finishing: list[tuple[Item, object, bool]] = []
        #: Makes this set's device runner (:class:`hora.nccl.dispatch.DeviceExecutor`) the first time
        #: a CUDA tensor on the NCCL path is negotiated, so a CPU-only job never touches CUDA or NCCL.
        self.device_runner_factory: Callable[[], DeviceRunner] | None = None
        self._device_runner: DeviceRunner | None = None

    def run(self, items: list[Item]) -> None:
        tl = self.timeline
        if tl is not None:  # every op opens now and queues until its bucket's turn
            for item in items:
                tl.start(item.response.name, item.response.signature.kind.value)
                tl.activity_start(item.response.name, "QUEUE")
        if len(items) == 1:  # the common steady-state cycle: nothing to plan
            self._activity(items, "QUEUE", False)
            response = items[0].response
            if response.signature.device and response.error is None:
                self._run_device(items)
            else:
                self._run_bucket(Bucket(None, items, 0))
            return
        # CUDA tensors on the NCCL path run after the host buckets, in negotiated order: the same
        # order on every member, which is what NCCL requires of its calls.
        device_items = [i for i in items if i.response.signature.device and i.response.error is None]
        if device_items:
            items = [i for i in items if not (i.response.signature.device and i.response.error is None)]
        for bucket in plan_buckets(items, self.threshold):
            self._activity(bucket.items, "QUEUE", False)
            self._run_bucket(bucket)
        if device_items:
            self._activity(device_items, "QUEUE", False)
            self._run_device(device_items)

    def _run_device(self, items: list[Item]) -> None:
        """Hand negotiated device items to the set's NCCL runner; it completes each with its framework
        tensor once the collective is enqueued and chained after on the framework's stream."""
        self._finishing = []
        try:
            runner = self._device_runner
            if runner is None:
                if self.device_runner_factory is None:
                    raise RuntimeError(f"rank {self.members[self.comm.rank]}: a CUDA tensor was negotiated for "
                                       "the NCCL path, but this engine has no device path")
                runner = self._device_runner = self.device_runner_factory()
            self._nccl_activity(items, True)
            try:
                runner.run(items, self._complete)
            finally:
                self._nccl_activity(items, False)
        finally:
            self._settle(items, None)

    @property
    def device_waiting(self) -> bool:
        """Whether device items wait for the GPU before they complete (the engine keeps cycling)."""
        runner = self._device_runner
        return runner is not None and runner.waiting

    def poll_device(self, finish: bool = False) -> int:
        """Complete device items whose GPU work has finished since they were run; returns how many.
        ``finish``: wait (bounded) for all of them first. Raises HorovodInternalError when that work
        cannot finish."""
        runner = self._device_runner
        if runner is None:
            return 0
        self._finishing = []
        try:
            return runner.poll(self._complete, finish)
        finally:
            self._settle([], None)

    def _nccl_activity(self, items: list[Item], start: bool) -> None:
        if self.timeline is not None:
            for item in items:
                self._activity([item], f"NCCL_{item.response.signature.kind.value}", start)

    def close_device(self) -> None:
        """Forget the device runner (its communicator is released by the engine's device context)."""
        self._device_runner = None

    # ---- helpers ------------------------------------------------------------------------------

    def _fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        allocate = self._allocate
        if allocate is not None:  # a transport buffer (shared memory) saves the transport a copy
            return allocate(count * np.dtype(dtype).itemsize).view(dtype)[:count]
        key = np.dtype(dtype).str
        buf = self._fusion.get(key)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype=dtype)
            self._fusion[key] = buf
        return buf[:count]

    def _stages(self, nbytes: int) -> bool:
        """Whether a lone tensor of ``nbytes`` is better copied into the transport's own buffer
        (shared memory: the transport then reduces in place instead of copying in and out itself)."""
        return self._allocate is not None and nbytes >= self._staged_min_bytes

    def _activity(self, items: list[Item], name: str, start: bool) -> None:
        if self.timeline is None:
            return
        for item in items:
            if start:
                self.timeline.activity_start(item.response.name, name)
            else:
                self.timeline.activity_end(item.response.name, name)

    def _run_bucket(self, bucket: Bucket) -> None:
        items = bucket.items
        first = items[0].response
        kind = first.signature.kind
        error: str | None = None
        self._finishing = []
        try:
            if first.error is not None:
                error = first.error
                for item in items:
                    self._finishing.append((item, CollectivePreconditionError(item.response.error), True))
            elif kind == Kind.ALLREDUCE:
                self._allreduce(items)
            elif kind == Kind.ALLGATHER:
                self._allgather(items)
            elif kind == Kind.BROADCAST:
                self._broadcast(items)
            elif kind == Kind.ALLTOALL:
                for item in items:  # a grouped collective's members share one (unfused) bucket
                    self._alltoall(item)
            elif kind == Kind.REDUCESCATTER:
                for item in items:
                    self._reducescatter(item)
            elif kind == Kind.BARRIER:
                self.comm.barrier()
                self._complete(items[0], None)
            elif kind == Kind.JOIN:
                self._complete(items[0], self._global_rank(first.last_joined))
        finally:
            self._settle(items, error)

    def _settle(self, items: list[Item], error: str | None) -> None:
        """End the items' timeline spans, do the engine's bookkeeping, then complete their handles."""
        tl = self.timeline
        if tl is not None:
            for item in items:
                sig = item.response.signature
                tl.end(item.response.name, sig.kind.value, sig.dtype, sig.shape, error)
        finishing, self._finishing = self._finishing, []
        self.before_complete([item for item, _, _ in finishing])
        for item, outcome, failed in finishing:
            if item.request is not None:
                if failed:
                    item.request.handle.set_error(cast(BaseException, outcome))  # failed: an exception
                else:
                    item.request.handle.set_result(outcome)

    def _global_rank(self, member: int) -> int:
        return self.members[member] if member >= 0 else member

    def _complete(self, item: Item, result: object) -> None:
        self._finishing.append((item, result, False))

    # ---- allreduce ----------------------------------------------------------------------------

    def _allreduce(self, items: list[Item]) -> None:
        sig = items[0].response.signature
        dtype = sig.np_dtype
        post = _postscale(sig, self.comm.size)
        op = _transport_op(sig)
        into = self._into
        if len(items) == 1 and into is not None and op is not _ADASUM and sig.prescale == 1.0:
            # The transport reduces straight from the caller's array into the result (shared memory:
            # one copy in, one copy out, pipelined), with no fusion buffer between.
            item = items[0]
            out = self._output_of(item, dtype)
            src = item.request.buffer if item.request is not None else out  # joined: zeros
            # Average's division (any postscale) rides on the transport's copy out.
            self._transport(items, lambda: into(src.reshape(-1), out.reshape(-1), op, post))
            self._complete(item, out)
            return
        if len(items) == 1 and not self._stages(sig.nbytes()):
            item = items[0]
            out = self._output_of(item, dtype)
            if item.request is not None and item.request.buffer is not out:
                self._activity(items, "MEMCPY_IN_FUSION_BUFFER", True)
                out[...] = item.request.buffer
                self._activity(items, "MEMCPY_IN_FUSION_BUFFER", False)
            _scale(out, sig.prescale)
            self._transport(items, lambda: self._reduce(out.reshape(-1), op, None))
            _scale(out, post)
            self._complete(item, out)
            return
        counts = [i.response.signature.count for i in items]
        total = sum(counts)
        fused = self._fusion_buffer(dtype, total)
        self._activity(items, "MEMCPY_IN_FUSION_BUFFER", True)
        inputs = [
            (item.request.buffer if item.request.buffer.ndim == 1 else item.request.buffer.reshape(-1))
            if item.request is not None else np.zeros(count, dtype=dtype)
            for item, count in zip(items, counts)
        ]
        if len(inputs) == 1:
            fused[...] = inputs[0]
        else:
            np.concatenate(inputs, out=fused)
        _scale(fused, sig.prescale)
        self._activity(items, "MEMCPY_IN_FUSION_BUFFER", False)
        self._transport(items, lambda: self._reduce(fused, op, counts))
        self._activity(items, "MEMCPY_OUT_FUSION_BUFFER", True)
        # The postscale (Average's division) is applied while copying out, not as a pass of its own.
        # Small buckets: one new array for every result that has no place of its own yet.
        shared = None
        if fused.nbytes <= _SHARED_RESULT_BYTES:
            shared = np.empty_like(fused)
            scale_into(fused, post, shared)
        offset = 0
        for item, count in zip(items, counts):
            request = item.request
            if request is not None:
                end = offset + count
                if request.output is None and shared is not None:
                    out = shared[offset:end].reshape(request.buffer.shape)
                    request.output = out
                else:
                    out = self._output_of(item, dtype)
                    scale_into(fused[offset:end], post, out.reshape(-1))
                self._complete(item, out)
            offset += count
        self._activity(items, "MEMCPY_OUT_FUSION_BUFFER", False)

    def _reduce(self, buf: np.ndarray, op: ReduceOp, counts: list[int] | None) -> None:
        """One transport allreduce, or Adasum (not element-wise: it runs on top of the transport's
        collectives, with each tensor of ``counts`` keeping its own coefficients)."""
        if op is _ADASUM:
            adasum.allreduce(self.comm, buf, counts)
        else:
            self.comm.allreduce(buf, op)

    @staticmethod
    def _output_of(item: Item, dtype: np.dtype) -> np.ndarray:
        request = item.request
        if request is None:  # joined rank: contributes zeros, keeps nothing
            return np.zeros(item.response.signature.shape, dtype=dtype)
        if request.output is None:
            request.output = np.empty_like(request.buffer)
        return request.output

    def _transport(self, items: list[Item], call: Callable[[], None]) -> None:
        if self.timeline is None:
            call()
            return
        activity = f"{self.activity}_{items[0].response.signature.kind.value}"
        self._activity(items, activity, True)
        try:
            call()
        finally:
            self._activity(items, activity, False)

    # ---- allgather ----------------------------------------------------------------------------

    def _allgather(self, items: list[Item]) -> None:
        dtype = items[0].response.signature.np_dtype
        size = self.comm.size
        me = self.comm.rank
        row_sizes = [i.response.signature.row_count for i in items]
        # Per member, the fused block is its tensors one after another.
        block = [sum(i.response.rows[m] * r for i, r in zip(items, row_sizes)) for m in range(size)]
        send = self._send_block(items, dtype, block[me])
        recv = np.empty(sum(block), dtype=dtype)
        self._transport(items, lambda: self.comm.allgather(send, recv, block))
        if len(items) == 1:  # the members' blocks, in order, are the output itself: no copy out
            item = items[0]
            self._complete(item, recv.reshape((sum(item.response.rows),) + tuple(item.response.signature.shape[1:])))
            return
        self._activity(items, "MEMCPY_OUT_FUSION_BUFFER", True)
        outputs = [
            np.empty((sum(i.response.rows),) + tuple(i.response.signature.shape[1:]), dtype=dtype)
            for i in items
        ]
        out_offsets = [0] * len(items)
        src = 0
        for m in range(size):
            for k, (item, row) in enumerate(zip(items, row_sizes)):
                count = item.response.rows[m] * row
                flat = outputs[k].reshape(-1)
                flat[out_offsets[k] : out_offsets[k] + count] = recv[src : src + count]
                out_offsets[k] += count
                src += count
        self._activity(items, "MEMCPY_OUT_FUSION_BUFFER", False)
        for item, out in zip(items, outputs):
            self._complete(item, out)

    def _send_block(self, items: list[Item], dtype: np.dtype, count: int) -> np.ndarray:
        if len(items) == 1:
            return np.ascontiguousarray(items[0].own_request().buffer).reshape(-1)
        self._activity(items, "MEMCPY_IN_FUSION_BUFFER", True)
        send = np.empty(count, dtype=dtype)
        offset = 0
        for item in items:
            flat = item.own_request().buffer.reshape(-1)
            send[offset : offset + flat.size] = flat
            offset += flat.size
        self._activity(items, "MEMCPY_IN_FUSION_BUFFER", False)
        return send

    # ---- broadcast ----------------------------------------------------------------------------

    def _broadcast(self, items: list[Item]) -> None:
        sig = items[0].response.signature
        dtype = sig.np_dtype
        root = self.members.index(sig.root)
        outs = []
        for item in items:
            out = self._output_of(item, dtype)
            if self.comm.rank == root and item.own_request().buffer is not out:
                out[...] = item.own_request().buffer
            outs.append(out)
        if len(items) == 1:
            self._transport(items, lambda: self.comm.broadcast(outs[0].reshape(-1), root))
        else:
            counts = [o.size for o in outs]
            fused = self._fusion_buffer(dtype, sum(counts))
            offset = 0
            if self.comm.rank == root:
                for o in outs:
                    fused[offset : offset + o.size] = o.reshape(-1)
                    offset += o.size
            self._transport(items, lambda: self.comm.broadcast(fused, root))
            offset = 0
            for o in outs:
                o.reshape(-1)[...] = fused[offset : offset + o.size]
                offset += o.size
        for item, out in zip(items, outs):
            self._complete(item, out)

    # ---- alltoall and reducescatter ------------------------------------------------------------

    def _alltoall(self, item: Item) -> None:
        response = item.response
        sig = response.signature
        dtype = sig.np_dtype
        me = self.comm.rank
        row = sig.row_count
        send_rows = list(response.splits[me])
        recv_rows = [response.splits[m][me] for m in range(self.comm.size)]
        buffer = item.own_request().buffer
        send = np.ascontiguousarray(buffer).reshape(-1)
        out = np.empty((sum(recv_rows),) + tuple(buffer.shape[1:]), dtype=dtype)
        self._transport(
            [item],
            lambda: self.comm.alltoall(
                send, [r * row for r in send_rows], out.reshape(-1), [r * row for r in recv_rows]
            ),
        )
        self._complete(item, (out, np.asarray(recv_rows, dtype=np.int64)))

    def _reducescatter(self, item: Item) -> None:
        sig = item.response.signature
        dtype = sig.np_dtype
        size = self.comm.size
        rows = reducescatter_blocks(sig, size)
        row = sig.row_count
        request = item.own_request()
        if request.donated and isinstance(request.buffer, np.ndarray) and request.buffer.dtype == dtype \
                and request.buffer.flags.c_contiguous and request.buffer.flags.writeable:
            send = request.buffer.reshape(-1)  # the caller's temporary: no copy of what may be a model's size
        else:  # the caller's tensor: scaled (and read by the transport) in a copy, so it stays as it was
            send = np.array(request.buffer, dtype=dtype, copy=True).reshape(-1)
        _scale(send, sig.prescale)
        out = np.empty((rows[self.comm.rank],) + tuple(sig.shape[1:]), dtype=dtype)
        op = _transport_op(sig)
        self._transport([item], lambda: self.comm.reducescatter(send, out.reshape(-1), [r * row for r in rows], op))
        _scale(out, _postscale(sig, size))
        self._complete(item, out)
