"""Collectives on MXNet NDArrays, with horovod.mxnet's names, arguments and defaults.

Each call copies the NDArray to a NumPy buffer (:mod:`hora.mxnet.tensors`), submits it through
hora's NumPy collectives and lands the result in a new NDArray (or the input, for the ``_`` forms).
Horovod pushed its MXNet collectives into MXNet's own engine and returned at once; hora's engine is
not MXNet's, so the plain forms return once the result is in the NDArray, and the ``_async`` forms
(a hora addition, as in ``hora.torch``) return a handle for :func:`poll` / :func:`synchronize`, so a
script can overlap communication with computation. ``priority`` is accepted everywhere, as Horovod
does; hora's engine serves requests in submission order, and a non-zero priority warns once.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np

from hora import collectives
from hora.basics import Average, ProcessSet, global_process_set
from hora.binding import (
    ConvertingHandle,
    new_each,
    new_one,
    poll as poll,
    synchronize as synchronize,
    write_each,
    write_one,
)
from hora.mxnet import tensors as adapter
from hora.mxnet.tensors import new_like, to_host

_priority_warned = False


def _note_priority(priority: int) -> None:
    global _priority_warned
    if priority and not _priority_warned:
        _priority_warned = True
        warnings.warn("hora.mxnet: priority is accepted for Horovod compatibility but has no effect "
                      "(hora's engine serves requests in the order ranks submit them)", UserWarning, stacklevel=3)


class MXHandle(ConvertingHandle):
    """What the ``_async`` collectives return: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ()


def _arrays(tensors: Sequence[mx.nd.NDArray], what: str) -> list[np.ndarray]:
    # Every tensor is checked before anything is submitted: a refused one leaves no peer waiting.
    return [to_host(t, what) for t in tensors]


# ---- allreduce ----------------------------------------------------------------------------------

def allreduce_async(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None, priority: int = 0,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, op: int | None = None) -> MXHandle:
    """Start reducing ``tensor`` across ranks (Average unless ``op``/``average`` say otherwise)."""
    _note_priority(priority)
    arr = to_host(tensor, "allreduce")
    handle = collectives.allreduce_async(arr, average, name, op, prescale_factor, postscale_factor, process_set)
    return MXHandle(handle, new_one(adapter, tensor))


def allreduce_async_(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None,
                     priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, op: int | None = None) -> MXHandle:
    """Start reducing ``tensor`` in place; :func:`synchronize` returns ``tensor`` holding the result."""
    _note_priority(priority)
    arr = to_host(tensor, "allreduce_")
    handle = collectives.allreduce_async_(arr, average, name, op, prescale_factor, postscale_factor, process_set)
    return MXHandle(handle, write_one(adapter, tensor))


def allreduce(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None, priority: int = 0,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: int | None = None) -> mx.nd.NDArray:
    """A new NDArray: ``tensor`` reduced across ranks. The input is not modified."""
    return synchronize(allreduce_async(tensor, average, name, priority, prescale_factor, postscale_factor,
                                       process_set, op))


def allreduce_(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None, priority: int = 0,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: int | None = None) -> mx.nd.NDArray:
    """Reduce ``tensor`` across ranks in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, priority, prescale_factor, postscale_factor,
                                        process_set, op))


def grouped_allreduce_async(tensors: Sequence[mx.nd.NDArray], average: bool | None = None, name: str | None = None,
                            priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, op: int | None = None) -> MXHandle:
    """Start reducing a list of NDArrays as one fused unit; :func:`synchronize` returns new NDArrays."""
    _note_priority(priority)
    tensors = list(tensors)
    handles = collectives.grouped_allreduce_async(_arrays(tensors, "grouped_allreduce"), average, name, op,
                                                  prescale_factor, postscale_factor, process_set)
    return MXHandle(handles, new_each(adapter, tensors))


def grouped_allreduce_async_(tensors: Sequence[mx.nd.NDArray], average: bool | None = None,
                             name: str | None = None, priority: int = 0, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                             op: int | None = None) -> MXHandle:
    """Start reducing a list of NDArrays in place, as one fused unit."""
    _note_priority(priority)
    tensors = list(tensors)
    handles = collectives.grouped_allreduce_async_(_arrays(tensors, "grouped_allreduce_"), average, name, op,
                                                   prescale_factor, postscale_factor, process_set)
    return MXHandle(handles, write_each(adapter, tensors))


def grouped_allreduce(tensors: Sequence[mx.nd.NDArray], average: bool | None = None, name: str | None = None,
                      priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, op: int | None = None) -> list[mx.nd.NDArray]:
    """New NDArrays: each of ``tensors`` reduced across ranks, all as one fused unit."""
    if not tensors:
        return list(tensors)
    return synchronize(grouped_allreduce_async(tensors, average, name, priority, prescale_factor, postscale_factor,
                                               process_set, op))


def grouped_allreduce_(tensors: Sequence[mx.nd.NDArray], average: bool | None = None, name: str | None = None,
                       priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set, op: int | None = None) -> list[mx.nd.NDArray]:
    """Reduce each of ``tensors`` in place, as one fused unit; returns them."""
    if not tensors:
        return list(tensors)
    return synchronize(grouped_allreduce_async_(tensors, average, name, priority, prescale_factor,
                                                postscale_factor, process_set, op))


# ---- allgather ----------------------------------------------------------------------------------

def allgather_async(tensor: mx.nd.NDArray, name: str | None = None, priority: int = 0,
                    process_set: ProcessSet = global_process_set) -> MXHandle:
    _note_priority(priority)
    handle = collectives.allgather_async(to_host(tensor, "allgather"), name, process_set)
    return MXHandle(handle, new_one(adapter, tensor))


def allgather(tensor: mx.nd.NDArray, name: str | None = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Every rank's ``tensor`` concatenated along dimension 0 (first dimensions may differ)."""
    return synchronize(allgather_async(tensor, name, priority, process_set))


def grouped_allgather_async(tensors: Sequence[mx.nd.NDArray], name: str | None = None, priority: int = 0,
                            process_set: ProcessSet = global_process_set) -> MXHandle:
    _note_priority(priority)
    tensors = list(tensors)
    handles = collectives.grouped_allgather_async(_arrays(tensors, "grouped_allgather"), name, process_set)
    return MXHandle(handles, new_each(adapter, tensors))


def grouped_allgather(tensors: Sequence[mx.nd.NDArray], name: str | None = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> list[mx.nd.NDArray]:
    """Allgather each NDArray of the list, as one fused unit."""
    if not tensors:
        return list(tensors)
    return synchronize(grouped_allgather_async(tensors, name, priority, process_set))


# ---- broadcast ----------------------------------------------------------------------------------

def broadcast_async(tensor: mx.nd.NDArray, root_rank: int, name: str | None = None, priority: int = 0,
                    process_set: ProcessSet = global_process_set) -> MXHandle:
    _note_priority(priority)
    handle = collectives.broadcast_async(to_host(tensor, "broadcast"), root_rank, name, process_set)
    return MXHandle(handle, new_one(adapter, tensor))


def broadcast_async_(tensor: mx.nd.NDArray, root_rank: int, name: str | None = None, priority: int = 0,
                     process_set: ProcessSet = global_process_set) -> MXHandle:
    _note_priority(priority)
    handle = collectives.broadcast_async_(to_host(tensor, "broadcast_"), root_rank, name, process_set)
    return MXHandle(handle, write_one(adapter, tensor))


def broadcast(tensor: mx.nd.NDArray, root_rank: int, name: str | None = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """A new NDArray holding ``root_rank``'s ``tensor`` (``root_rank`` is a global rank)."""
    return synchronize(broadcast_async(tensor, root_rank, name, priority, process_set))


def broadcast_(tensor: mx.nd.NDArray, root_rank: int, name: str | None = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Overwrite ``tensor`` with ``root_rank``'s value and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, priority, process_set))


# ---- alltoall -----------------------------------------------------------------------------------

def _splits(splits: Any) -> Any:
    return splits.asnumpy() if isinstance(splits, mx.nd.NDArray) else splits


def alltoall_async(tensor: mx.nd.NDArray, splits: Any = None, name: str | None = None, priority: int = 0,
                   process_set: ProcessSet = global_process_set) -> MXHandle:
    """Start sending ``splits[j]`` rows to rank j; :func:`synchronize` returns (output, received_splits)."""
    _note_priority(priority)
    handle = collectives.alltoall_async(to_host(tensor, "alltoall"), _splits(splits), name, process_set)
    return MXHandle(handle, lambda res: (new_like(res[0], tensor),
                                         mx.nd.array(res[1], ctx=mx.cpu(), dtype="int32")))


def alltoall(tensor: mx.nd.NDArray, splits: Any = None, name: str | None = None, priority: int = 0,
             process_set: ProcessSet = global_process_set) -> Any:
    """The rows every rank sent here; with ``splits`` given, also the rows received from each rank."""
    output, received = synchronize(alltoall_async(tensor, splits, name, priority, process_set))
    return output if splits is None else (output, received)


# ---- reducescatter ------------------------------------------------------------------------------

def reducescatter_async(tensor: mx.nd.NDArray, op: int = Average, name: str | None = None, priority: int = 0,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> MXHandle:
    _note_priority(priority)
    handle = collectives.reducescatter_async(to_host(tensor, "reducescatter"), name, op, process_set,
                                             prescale_factor, postscale_factor)
    return MXHandle(handle, new_one(adapter, tensor))


def reducescatter(tensor: mx.nd.NDArray, op: int = Average, name: str | None = None, priority: int = 0,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> mx.nd.NDArray:
    """Reduce across ranks (Sum or Average), then keep this rank's block of rows."""
    return synchronize(reducescatter_async(tensor, op, name, priority, process_set, prescale_factor,
                                           postscale_factor))


def grouped_reducescatter_async(tensors: Sequence[mx.nd.NDArray], op: int = Average, name: str | None = None,
                                priority: int = 0, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> MXHandle:
    _note_priority(priority)
    tensors = list(tensors)
    handles = collectives.grouped_reducescatter_async(_arrays(tensors, "grouped_reducescatter"), name, op,
                                                      process_set, prescale_factor, postscale_factor)
    return MXHandle(handles, new_each(adapter, tensors))


def grouped_reducescatter(tensors: Sequence[mx.nd.NDArray], op: int = Average, name: str | None = None,
                          priority: int = 0, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[mx.nd.NDArray]:
    """Reducescatter each NDArray of the list, as one fused unit."""
    if not tensors:
        return list(tensors)
    return synchronize(grouped_reducescatter_async(tensors, op, name, priority, process_set, prescale_factor,
                                                   postscale_factor))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has reached the barrier (a hora addition)."""
    collectives.barrier(process_set)


__all__ = [
    "MXHandle", "poll", "synchronize", "barrier",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
]
