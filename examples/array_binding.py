"""A whole hora binding in one file, for Python's own typed arrays (``array.array``).

This is the binding ``docs/architecture.md`` walks through ("Adding a binding"): the framework here is
the standard library's ``array`` module, so the walk-through runs anywhere hora does, and
``tests/test_binding_walkthrough.py`` runs it on 2 ranks. A binding for a real framework has the same
three parts, in the same order:

1. the adapter: four functions that turn the framework's tensors into the engine's NumPy buffers and
   back (``check_dtype``, ``to_host``, ``new_like``, ``write_into``);
2. the collectives, each the same three steps: check and convert, call :mod:`hora.collectives`, hand
   back the kit's handle with a function that finishes the result;
3. the optimizer, which reduces a list of gradients through :mod:`hora.binding.batched` under
   Horovod's rules (:mod:`hora.horovod_args`) and then lets the framework's own optimizer step.

Everything else (``init``, ``rank``, the reduce ops, process sets, Horovod's errors, ``poll`` and
``synchronize``) is re-exported from the kit, as every binding does.

Run it: ``hora run -np 2 python examples/array_binding.py``.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

import numpy as np

from hora import collectives
from hora.basics import Average, ProcessSet, global_process_set
from hora.binding import ConvertingHandle, new_each, new_one, poll, synchronize
from hora.binding.batched import gradient_names, reduce_arrays
from hora.binding.common_api import *  # noqa: F403 (init, rank, size, Sum, ...: the names every binding shares)
from hora.binding.common_api import init, rank, size
from hora.compression import Compression
from hora.errors import UnsupportedOperationError
from hora.horovod_args import GradientReduction, check_compression

# ---- 1. the adapter ------------------------------------------------------------------------------

#: The typecodes whose items the engine reduces, as NumPy dtypes. ``array`` also has unsigned 32- and
#: 64-bit integers and characters, which hora's engine does not take (nor does Horovod's).
ENGINE_DTYPES = {"b": np.int8, "B": np.uint8, "h": np.int16, "H": np.uint16, "i": np.int32, "l": np.int64,
                 "q": np.int64, "f": np.float32, "d": np.float64}


def check_dtype(tensor: array.array, /) -> None:
    """Refuse, on this rank and before anything is submitted, what the engine cannot take: a refused
    tensor must not leave a peer waiting on a collective this rank never joins."""
    if not isinstance(tensor, array.array):
        raise TypeError(f"array_binding: expected an array.array, got {type(tensor).__name__}")
    if tensor.typecode not in ENGINE_DTYPES:
        raise UnsupportedOperationError(f"array_binding: typecode {tensor.typecode!r} has no engine dtype; "
                                        f"use one of {''.join(ENGINE_DTYPES)}")


def to_host(tensor: array.array, /) -> np.ndarray:
    """The array's own memory as a NumPy view (an ``array.array`` exports its buffer, writable), so
    an in-place collective writes straight into it. (While the view lives the array cannot grow.)"""
    check_dtype(tensor)
    return np.frombuffer(tensor, dtype=ENGINE_DTYPES[tensor.typecode])


def new_like(result: np.ndarray, like: array.array, /) -> array.array:
    """A new ``array.array`` of ``like``'s typecode holding ``result`` (a collective's output)."""
    out = array.array(like.typecode)
    out.frombytes(np.ascontiguousarray(result, dtype=ENGINE_DTYPES[like.typecode]).tobytes())
    return out


def write_into(tensor: array.array, result: np.ndarray, /) -> array.array:
    """Copy ``result`` into ``tensor``'s memory; ``tensor``."""
    to_host(tensor)[:] = result.reshape(-1)
    return tensor


# ---- 2. the collectives --------------------------------------------------------------------------

adapter = sys.modules[__name__]  # this module is the adapter: the kit's finishing helpers take it


class ArrayHandle(ConvertingHandle):
    """What the ``_async`` collectives return: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ()


def allreduce_async(tensor: array.array, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> ArrayHandle:
    """Start reducing ``tensor`` across ranks; :func:`synchronize` returns a new array."""
    handle = collectives.allreduce_async(to_host(tensor), average, name, op, prescale_factor, postscale_factor,
                                         process_set)
    return ArrayHandle(handle, new_one(adapter, tensor))


def allreduce(tensor: array.array, average: bool | None = None, name: str | None = None, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> array.array:
    """A new array: ``tensor`` reduced across ranks."""
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async_(tensor: array.array, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> ArrayHandle:
    """Start reducing ``tensor`` in place. ``to_host`` gave a view, so the engine writes the result
    into the array itself and finishing only hands the array back (a binding whose ``to_host`` copies
    finishes with ``hora.binding.write_one`` instead)."""
    handle = collectives.allreduce_async_(to_host(tensor), average, name, op, prescale_factor, postscale_factor,
                                          process_set)
    return ArrayHandle(handle, lambda _: tensor)


def allreduce_(tensor: array.array, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> array.array:
    """Reduce ``tensor`` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce(tensors: Sequence[array.array], average: bool | None = None, name: str | None = None,
                      op: int | None = None, process_set: ProcessSet = global_process_set) -> list[array.array]:
    """New arrays: the tensors reduced as one unit. Every tensor is checked before any is submitted."""
    tensors = list(tensors)
    hosts = [to_host(t) for t in tensors]
    handles = collectives.grouped_allreduce_async(hosts, average, name, op, 1.0, 1.0, process_set)
    return synchronize(ArrayHandle(handles, new_each(adapter, tensors)))


def allgather(tensor: array.array, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> array.array:
    """Every rank's items, rank after rank (the lengths may differ)."""
    handle = collectives.allgather_async(to_host(tensor), name, process_set)
    return synchronize(ArrayHandle(handle, new_one(adapter, tensor)))


def broadcast_(tensor: array.array, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> array.array:
    """``root_rank``'s items, written into ``tensor`` on every rank."""
    handle = collectives.broadcast_async_(to_host(tensor), root_rank, name, process_set)
    return synchronize(ArrayHandle(handle, lambda _: tensor))


# ---- 3. the optimizer ----------------------------------------------------------------------------

class SGD:
    """The framework's own optimizer: ``p -= lr * g``, item by item."""

    def __init__(self, params: Sequence[array.array], lr: float) -> None:
        self.params, self.lr = list(params), lr

    def step(self, grads: Sequence[array.array]) -> None:
        for p, g in zip(self.params, grads):
            to_host(p)[:] -= self.lr * to_host(g)


class DistributedOptimizer:
    """Wraps the framework's optimizer: ``step(grads)`` averages the gradients across ranks first.

    Horovod's arguments, with Horovod's rules from :mod:`hora.horovod_args`: ``op`` and
    ``gradient_predivide_factor`` become one :class:`GradientReduction`, ``compression`` is checked
    once, here (and ``HORA_COMPRESSION`` applies to the default), and the names are fixed per
    position, so every step after the first hits the engine's response cache."""

    def __init__(self, optimizer: SGD, name: str = "DistributedSGD", compression=Compression.none,
                 op: int = Average, gradient_predivide_factor: float = 1.0,
                 process_set: ProcessSet = global_process_set) -> None:
        self.optimizer = optimizer
        self._reduction = GradientReduction.create(op, gradient_predivide_factor, process_set)
        self._compression = check_compression(compression)
        self._names = gradient_names(name, len(optimizer.params))

    def step(self, grads: Sequence[array.array]) -> None:
        grads = list(grads)
        compressed = [self._compression.compress(to_host(g)) for g in grads]  # (array, context) pairs
        reduced = reduce_arrays([sent for sent, _ in compressed], self._names, self._reduction)
        for g, r, (_, context) in zip(grads, reduced, compressed):
            write_into(g, self._compression.decompress(r, context))
        self.optimizer.step(grads)


__all__ = ["ArrayHandle", "DistributedOptimizer", "SGD", "allgather", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "broadcast_", "check_dtype", "grouped_allreduce", "new_like", "poll", "synchronize",
           "to_host", "write_into"]


def main() -> None:
    """Fit ``y = 3x`` with one weight, each rank on its own points, gradients averaged."""
    init()
    weight = array.array("d", [0.0])
    broadcast_(weight, root_rank=0)
    optimizer = DistributedOptimizer(SGD([weight], lr=0.01))
    xs = np.arange(1.0, 5.0) + rank()  # a different shard of x on each rank
    for _ in range(100):
        error = weight[0] * xs - 3.0 * xs
        optimizer.step([array.array("d", [float(np.mean(2.0 * error * xs))])])  # d(mean squared error)/dw
    print(f"rank {rank()} of {size()}: weight {weight[0]:.6f}")


if __name__ == "__main__":
    main()
