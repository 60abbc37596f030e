"""What a binding knows about its framework's tensors: four operations, the same names in every binding.

The engine reduces NumPy buffers; everything framework-specific about getting a tensor there and a
result back is these four functions, defined at module level in the binding's tensors module
(``hora.torch.tensors``, ``hora.mxnet.tensors``, ``hora.jax.arrays``, ``hora.tensorflow.tensors``),
which is then an :class:`Adapter` (a module satisfies a protocol: no instance, no extra call on the
hot path). A binding calls them directly; the finishing helpers here take the module itself, so
they and any later binding need no other knowledge of the framework. Each binding adds only what
its framework really has besides: a device path (NCCL through DLPack or CUDA pointers), autograd,
``jax.jit``, TensorFlow graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np

T = TypeVar("T")


@runtime_checkable
class Adapter(Protocol[T]):
    """A framework's tensors as the engine's NumPy buffers (see the module docstring)."""

    def check_dtype(self, tensor: T, /) -> None:
        """Refuse what the engine cannot take (not this framework's tensor; a dtype, storage or placement
        hora lacks), in the caller's thread: a binding checks every tensor of a call before it submits
        any, so that a refused one leaves no peer waiting."""

    def to_host(self, tensor: T, /) -> np.ndarray:
        """The engine's buffer for ``tensor``: a view of its memory where the layout allows (then an
        in-place collective writes straight into the tensor), else a host copy."""

    def new_like(self, array: np.ndarray, like: T, /) -> T:
        """A new tensor holding ``array`` (a collective's result), where ``like`` (its input) lives."""

    def write_into(self, tensor: T, array: np.ndarray, /) -> T:
        """Copy ``array`` into ``tensor`` (the in-place forms, where ``to_host`` made a copy); ``tensor``."""


def new_one(adapter: Adapter[T], like: T) -> Callable[[np.ndarray], T]:
    """The ``finish`` of a collective's handle: its result a new tensor where its input ``like`` lives."""
    new_like = adapter.new_like
    return lambda result: new_like(result, like)


def new_each(adapter: Adapter[T], likes: Sequence[T]) -> Callable[[Sequence[np.ndarray]], list[T]]:
    """The ``finish`` of a grouped collective's handle: each result a new tensor where its input lives."""
    new_like, likes = adapter.new_like, list(likes)
    return lambda results: [new_like(r, t) for r, t in zip(results, likes)]


def write_one(adapter: Adapter[T], tensor: T) -> Callable[[np.ndarray], T]:
    """The ``finish`` of an in-place collective whose buffer is a host copy: the result written back
    into ``tensor``."""
    write_into = adapter.write_into
    return lambda result: write_into(tensor, result)


def write_each(adapter: Adapter[T], tensors: Sequence[T]) -> Callable[[Sequence[np.ndarray]], list[T]]:
    """The ``finish`` of a grouped in-place collective whose buffers are host copies: each result
    written back into its tensor."""
    write_into, tensors = adapter.write_into, list(tensors)
    return lambda results: [write_into(t, r) for t, r in zip(tensors, results)]

