"""Collectives on NumPy arrays: hora's own binding, and the model the framework bindings follow.

Each collective has an ``_async`` form returning a handle at once and a synchronous form that waits.
Arguments, defaults and errors follow Horovod 0.28.1's public API.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, overload

import cloudpickle
import numpy as np

from hora import basics
from hora.basics import Adasum, Average, ProcessSet, global_process_set
from hora.device_requests import cuda_request, is_cuda
from hora.engine import adasum
from hora.engine.executor import reducescatter_rows
from hora.engine.request import Handle, Kind, Request, dtype_name, signature, with_through_join
from hora.horovod_args import check_sum_or_average, resolve_op
from hora.transport.base import SUPPORTED_DTYPES

_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def _as_array(tensor: Any, what: str = "tensor") -> np.ndarray:
    arr = tensor
    if type(arr) is not np.ndarray or not arr.flags.c_contiguous:
        arr = np.asarray(tensor)  # not np.ascontiguousarray alone: it turns a scalar into shape (1,)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
    if arr.dtype not in _SUPPORTED:
        raise TypeError(
            f"{what} has dtype {arr.dtype}; hora supports "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    return arr


def _check_op_dtype(op: int, dtype: np.dtype) -> None:
    if dtype == np.bool_ and op in (Average,):
        raise TypeError("Average is not defined for bool tensors; use Sum (logical or) or Min (logical and)")


_THROUGH_JOIN: ContextVar[bool] = ContextVar("hora_through_join", default=False)


@contextmanager
def through_join() -> Iterator[None]:
    """Collectives submitted inside this block (in this thread or task) run through join: every rank
    takes part, a joined one included, and negotiation waits for it (hora's sharded optimizers, whose
    joined ranks keep stepping their shards: :mod:`hora.torch.sharded_join`). Every rank must submit
    such a collective the same way; ranks that disagree fail negotiation, naming it."""
    token = _THROUGH_JOIN.set(True)
    try:
        yield
    finally:
        _THROUGH_JOIN.reset(token)


def _submit(requests: list[Request]) -> list[Handle]:
    if _THROUGH_JOIN.get():
        for request in requests:
            request.signature = with_through_join(request.signature)
    return basics.engine().submit(requests)


#: For bindings that build their own requests (CUDA tensors on NCCL: hora.torch.device).
submit_requests = _submit


def _device_request(kind: Kind, tensor: Any, name: str | None, process_set: ProcessSet,
                    **fields: Any) -> Request:
    """The NCCL request for a CUDA array (``is_cuda``): required, so it exists or an error says why."""
    request = cuda_request(kind, tensor, name, process_set, required=True, **fields)
    assert request is not None  # required=True: a CUDA array takes the device path or raises
    return request


def _request(kind: Kind, name: str | None, arr: np.ndarray | None, process_set: ProcessSet,
             output: np.ndarray | None = None, **fields: Any) -> Request:
    set_id = basics.process_set_id(process_set)
    name = name if name is not None else basics.engine().auto_name(kind.value, set_id)
    dtype = dtype_name(arr.dtype) if arr is not None else "uint8"
    shape = tuple(arr.shape) if arr is not None else ()
    sig = signature(kind, dtype, shape, **fields)
    return Request(name, sig, arr, Handle(name), set_id, output=output)


# ---- allreduce ----------------------------------------------------------------------------------

def _allreduce_request(tensor: Any, average: bool | None, name: str | None, op: int | None,
                       prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                       inplace: bool = False, group: str = "", group_size: int = 0) -> Request:
    # The training hot path (every gradient, every step): positional arguments, no keyword packing.
    op = resolve_op(op, average)
    if type(tensor) is not np.ndarray and is_cuda(tensor):  # CuPy, or any CUDA array: NCCL
        return _device_request(Kind.ALLREDUCE, tensor, name, process_set, op=op, prescale=prescale_factor,
                               postscale=postscale_factor, group=group, group_size=group_size, inplace=inplace)
    arr = tensor if inplace else _as_array(tensor)
    if inplace:
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or not arr.flags.writeable:
            raise ValueError("in-place allreduce needs a writeable, C-contiguous numpy array")
        _as_array(arr)
    dtype = arr.dtype
    if op == Average and dtype.kind == "b":
        _check_op_dtype(op, dtype)
    set_id = basics.process_set_id(process_set)
    if name is None:
        name = basics.engine().auto_name(Kind.ALLREDUCE.value, set_id)
    if op is Adasum:
        adasum.check_dtype(dtype, basics.rank(), name)
    sig = signature(Kind.ALLREDUCE, dtype_name(dtype), arr.shape, op, -1, float(prescale_factor),
                    float(postscale_factor), group, group_size)
    return Request(name, sig, arr, Handle(name), set_id, arr if inplace else None)


def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start averaging (or summing, ...) ``tensor`` across ranks; ``synchronize`` returns a new array."""
    request = _allreduce_request(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _submit([request])[0]


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async_(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In place: the result overwrites ``tensor``."""
    request = _allreduce_request(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                                 inplace=True)
    return _submit([request])[0]


def allreduce_(tensor: np.ndarray, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _group_names(name: str | None, count: int, kind: str, process_set: ProcessSet) -> tuple[str, list[str]]:
    base = name if name is not None else basics.next_name(f"grouped_{kind}", process_set)
    return base, [f"{base}.{i}" for i in range(count)]


group_names = _group_names  # the grouped collectives' naming, shared with bindings that submit their own


def grouped_allreduce_async(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> list[Handle]:
    """Reduce a list of tensors as one fused unit (they are negotiated and sent together)."""
    base, names = _group_names(name, len(tensors), "allreduce", process_set)
    requests = [
        _allreduce_request(t, average, n, op, prescale_factor, postscale_factor, process_set,
                           group=base, group_size=len(tensors))
        for t, n in zip(tensors, names)
    ]
    return _submit(requests) if requests else []


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> list[Handle]:
    """In place: each result overwrites its input array."""
    base, names = _group_names(name, len(tensors), "allreduce", process_set)
    requests = [
        _allreduce_request(t, average, n, op, prescale_factor, postscale_factor, process_set,
                           inplace=True, group=base, group_size=len(tensors))
        for t, n in zip(tensors, names)
    ]
    return _submit(requests) if requests else []


def grouped_allreduce_(tensors: Sequence[np.ndarray], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    handles = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return [synchronize(h) for h in handles]


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                      op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    handles = grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return [synchronize(h) for h in handles]


# ---- allgather ----------------------------------------------------------------------------------

def _allgather_request(tensor: Any, name: str | None, process_set: ProcessSet,
                       group: str = "", group_size: int = 0) -> Request:
    if type(tensor) is not np.ndarray and is_cuda(tensor):
        return _device_request(Kind.ALLGATHER, tensor, name, process_set, group=group, group_size=group_size)
    arr = _as_array(tensor)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    return _request(Kind.ALLGATHER, name, arr, process_set, group=group, group_size=group_size)


def allgather_async(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Handle:
    """Concatenate every rank's tensor along the first dimension (first dimensions may differ)."""
    return _submit([_allgather_request(tensor, name, process_set)])[0]


def allgather(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> list[Handle]:
    base, names = _group_names(name, len(tensors), "allgather", process_set)
    requests = [_allgather_request(t, n, process_set, base, len(tensors)) for t, n in zip(tensors, names)]
    return _submit(requests) if requests else []


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    return [synchronize(h) for h in grouped_allgather_async(tensors, name, process_set)]


# ---- broadcast ----------------------------------------------------------------------------------

def check_root(root_rank: int, process_set: ProcessSet) -> None:
    """A broadcast's root must be a member of its process set (every binding checks it here)."""
    if int(root_rank) not in process_set.ranks:
        raise ValueError(f"root_rank {root_rank} is not in the process set (ranks {process_set.ranks})")


def _broadcast_request(tensor: Any, root_rank: int, name: str | None, process_set: ProcessSet,
                       inplace: bool) -> Request:
    check_root(root_rank, process_set)
    if type(tensor) is not np.ndarray and is_cuda(tensor):
        return _device_request(Kind.BROADCAST, tensor, name, process_set, root=int(root_rank), inplace=inplace)
    arr = tensor if inplace else _as_array(tensor)
    if inplace and (not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or not arr.flags.writeable):
        raise ValueError("in-place broadcast needs a writeable, C-contiguous numpy array")
    _as_array(arr)
    return _request(Kind.BROADCAST, name, arr, process_set, output=arr if inplace else None, root=int(root_rank))


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start copying ``root_rank``'s tensor to every rank (``root_rank`` is a global rank)."""
    return _submit([_broadcast_request(tensor, root_rank, name, process_set, False)])[0]


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    return _submit([_broadcast_request(tensor, root_rank, name, process_set, True)])[0]


def broadcast_(tensor: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall -----------------------------------------------------------------------------------

def alltoall_splits(shape: tuple[int, ...], splits: Any, process_set: ProcessSet) -> list[int]:
    """The rows sent to each member: ``splits`` checked against ``shape``, or equal shares when None."""
    if not shape:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    n = len(process_set.ranks)
    if splits is None:
        if shape[0] % n:
            raise ValueError(f"alltoall without splits needs the first dimension ({shape[0]}) "
                             f"divisible by the number of ranks ({n})")
        return [shape[0] // n] * n
    split_list = [int(s) for s in np.asarray(splits).reshape(-1)]
    if len(split_list) != n or sum(split_list) != shape[0] or min(split_list) < 0:
        raise ValueError(f"splits {split_list} must have {n} non-negative entries adding up to "
                         f"the first dimension {shape[0]}")
    return split_list


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Send ``splits[j]`` rows (first dimension) to rank j; equal splits when None."""
    on_cuda = type(tensor) is not np.ndarray and is_cuda(tensor)
    arr = tensor if on_cuda else _as_array(tensor)  # a CUDA array: only its shape is read here
    split_list = alltoall_splits(tuple(arr.shape), splits, process_set)
    if on_cuda:
        request = _device_request(Kind.ALLTOALL, tensor, name, process_set, splits=tuple(split_list))
        return _submit([request])[0]
    handle = _submit([_request(Kind.ALLTOALL, name, arr, process_set, splits=tuple(split_list))])[0]
    return handle


@overload
def alltoall(tensor: Any, splits: None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> np.ndarray: ...
@overload
def alltoall(tensor: Any, splits: Any, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[np.ndarray, np.ndarray]: ...
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The received rows; with ``splits`` given, also how many rows came from each rank."""
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


# ---- reducescatter ------------------------------------------------------------------------------

def _reducescatter_request(tensor: Any, name: str | None, op: int, process_set: ProcessSet,
                           prescale_factor: float, postscale_factor: float,
                           group: str = "", group_size: int = 0, blocks: Any = None) -> Request:
    op = check_sum_or_average(op, "reducescatter")
    if type(tensor) is not np.ndarray and is_cuda(tensor):
        split = reducescatter_splits(tuple(tensor.shape), blocks, process_set)
        return _device_request(Kind.REDUCESCATTER, tensor, name, process_set, op=op, prescale=prescale_factor,
                               postscale=postscale_factor, group=group, group_size=group_size, splits=split)
    arr = _as_array(tensor)
    if arr.ndim == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    _check_op_dtype(op, arr.dtype)
    return _request(Kind.REDUCESCATTER, name, arr, process_set, op=op,
                    prescale=float(prescale_factor), postscale=float(postscale_factor),
                    group=group, group_size=group_size,
                    splits=reducescatter_splits(tuple(arr.shape), blocks, process_set))


def reducescatter_splits(shape: tuple[int, ...], blocks: Any, process_set: ProcessSet) -> tuple[int, ...]:
    """``blocks`` checked against ``shape`` (() for Horovod's equal blocks): every member must name the
    same blocks, which negotiation compares, so only their sum and count are checked here."""
    if blocks is None:
        return ()
    if not shape:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    rows = [int(b) for b in np.asarray(blocks).reshape(-1)]
    n = len(process_set.ranks)
    if len(rows) != n or min(rows, default=0) < 0 or sum(rows) != shape[0]:
        raise ValueError(f"reducescatter blocks {rows} must have {n} non-negative entries (one per member of "
                         f"the process set) adding up to the first dimension {shape[0]}")
    return tuple(rows)


def reducescatter_async(tensor: Any, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, blocks: Any = None, donate: bool = False) -> Handle:
    """Reduce across ranks, then give rank i the i-th block of rows (earlier ranks get the remainder).

    ``blocks`` (a hora addition, the same on every rank): the rows each member receives, in member
    order, where equal blocks will not do (sharded gradients give each member its own parameters).
    ``donate=True`` (a hora addition): the caller gives the array up to the collective, which may
    then read and scale it in place instead of copying it (a buffer packed for this call alone)."""
    request = _reducescatter_request(tensor, name, op, process_set, prescale_factor, postscale_factor, blocks=blocks)
    request.donated = bool(donate)
    return _submit([request])[0]


def reducescatter(tensor: Any, name: str | None = None, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, *, blocks: Any = None, donate: bool = False) -> np.ndarray:
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor,
                                           blocks=blocks, donate=donate))


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> list[Handle]:
    base, names = _group_names(name, len(tensors), "reducescatter", process_set)
    requests = [_reducescatter_request(t, n, op, process_set, prescale_factor, postscale_factor, base, len(tensors))
                for t, n in zip(tensors, names)]
    return _submit(requests) if requests else []


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[np.ndarray]:
    handles = grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor, postscale_factor)
    return [synchronize(h) for h in handles]


# ---- control ------------------------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has reached the barrier."""
    synchronize(basics.submit_control(Kind.BARRIER, basics.next_name("barrier", process_set), process_set))


def join(device: int = -1) -> int:
    """Declare this rank out of data; it contributes zeros until every rank joins. Returns the last to join."""
    return int(synchronize(join_async()))


def join_async() -> Handle:
    """:func:`join` started: the handle's result is the last rank to join (for a binding that keeps
    working while joined, as hora.torch does for its sharded optimizers)."""
    return basics.submit_control(Kind.JOIN, basics.next_name("join"))


def poll(handle: Handle) -> bool:
    """True once the collective behind ``handle`` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for the collective and return its result; raises its error in this thread."""
    return handle.wait()


# ---- objects ------------------------------------------------------------------------------------

def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object, on every rank of the process set."""
    base = name if name is not None else basics.next_name("broadcast_object", process_set)
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8) if basics.rank() == root_rank else None
    length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
    length = broadcast(length, root_rank, f"{base}.size", process_set)
    buf = payload if payload is not None else np.zeros(int(length[0]), dtype=np.uint8)
    data = broadcast(buf, root_rank, f"{base}.data", process_set)
    return obj if payload is not None else cloudpickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    base = name if name is not None else basics.next_name("allgather_object", process_set)
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    sizes = allgather(np.array([payload.size], dtype=np.int64), f"{base}.sizes", process_set)
    data = allgather(payload, f"{base}.data", process_set)
    out, offset = [], 0
    for n in sizes:
        out.append(cloudpickle.loads(data[offset : offset + int(n)].tobytes()))
        offset += int(n)
    return out


__all__ = [
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "join", "poll", "synchronize", "broadcast_object", "allgather_object",
    "reducescatter_rows",
]
