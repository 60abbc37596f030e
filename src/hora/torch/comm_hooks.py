"""Communication hooks for hora.torch.DistributedOptimizer, in the spirit of DDP's ``register_comm_hook``.

``hvd.DistributedOptimizer(opt, named_parameters=..., comm_hook=hook)`` hands each gradient bucket, as
soon as the backward pass has filled it, to ``hook(bucket)`` instead of hora's own allreduce. The hook
returns a future whose ``wait()`` gives the reduced bucket: a tensor of the bucket's elements, which
``synchronize()`` writes into the gradients. A hook can compress, reduce in another way, or log, without
hora knowing how; it must run the same collectives, under the same names, on every rank of the set.

The buckets are the optimizer's (``HORA_GRADIENT_BUCKET_BYTES``, consecutive parameters in reverse
registration order, one dtype each); with a hook every gradient travels in one, a parameter alone in
a bucket of one. :class:`HookFuture` turns a hora handle into the future a hook returns; its ``then``
chains a step after the collective (decompression, say), run when ``synchronize()`` waits.

The hooks here: :func:`allreduce_hook` (what hora does without a hook), :func:`fp16_compress_hook`
and :func:`bf16_compress_hook` (the bucket travels as float16 or bfloat16 and is cast back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hora.basics import Average, ProcessSet
from hora.binding import ConvertingHandle, as_is
from hora.torch import mpi_ops

__all__ = ["GradBucket", "HookFuture", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


class HookFuture(ConvertingHandle):
    """The future a hook returns: ``wait()`` gives its value, waiting for the collective behind it.

    hora's engine runs its cycles in the thread that waits (see ``hora.engine.request.Handle``), so a
    hook's future completes when ``synchronize()`` waits on it, not through a callback; ``then``
    therefore chains lazily: the callback runs, once, in the waiting thread, with the completed parent.
    It is the binding kit's handle (``wait``, ``poll`` and ``done`` come from there); a hook may also
    return any object with ``wait()``, a completed ``torch.futures.Future`` included.
    """

    __slots__ = ()

    @classmethod
    def of(cls, handle: ConvertingHandle) -> HookFuture:
        """The future of a handle from one of hora.torch's ``_async`` collectives."""
        return cls(handle, as_is)

    def value(self) -> Any:
        """The value: torch's ``Future.value()``, which a ``then`` callback reads from its argument."""
        return self.wait()

    def then(self, callback: Callable[[HookFuture], Any]) -> HookFuture:
        """A future of ``callback(self)``, run after this one completes."""
        return HookFuture(self, lambda _completed: callback(self))


class GradBucket:
    """What a hook receives: one bucket of gradients, flat, and where it belongs."""

    __slots__ = ("_index", "_buffer", "_parameters", "_names", "_gradients", "_is_last", "process_set", "name")

    def __init__(self, index: int, buffer: torch.Tensor, parameters: list[torch.Tensor], names: list[str],
                 gradients: list[torch.Tensor], is_last: bool, process_set: ProcessSet, name: str) -> None:
        self._index, self._buffer, self._parameters = index, buffer, parameters
        self._names, self._gradients, self._is_last = names, gradients, is_last
        #: The process set the optimizer reduces over: a hook's collectives take it.
        self.process_set = process_set
        #: A name for the bucket's collective, the same on every rank (every rank plans the same buckets).
        self.name = name

    def index(self) -> int:
        """The bucket's position in the optimizer's plan (0 is filled first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The bucket's gradients, flat (1-D): this rank's own, not yet reduced. Each gradient's slot
        starts at a multiple of 16 bytes, so zeros may sit between them (an element-wise reduction
        keeps them zero); :meth:`gradients` are the views. A hook may reduce it in place and return it."""
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)

    def names(self) -> list[str]:
        """The parameters' names (from ``named_parameters``), in :meth:`parameters` order."""
        return list(self._names)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view into :meth:`buffer`, shaped (and strided) like it."""
        return list(self._gradients)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the step's plan."""
        return self._is_last


def allreduce_hook(bucket: GradBucket) -> HookFuture:
    """Average the bucket across the process set, in place: what DistributedOptimizer does without a hook."""
    handle = mpi_ops.allreduce_async_(bucket.buffer(), name=bucket.name, op=Average,
                                      process_set=bucket.process_set)
    return HookFuture.of(handle)


def _cast_hook(bucket: GradBucket, dtype: torch.dtype) -> HookFuture:
    buffer = bucket.buffer()
    if not buffer.is_floating_point() or buffer.dtype == dtype:
        return allreduce_hook(bucket)
    handle = mpi_ops.allreduce_async_(buffer.to(dtype), name=bucket.name, op=Average,
                                      process_set=bucket.process_set)
    return HookFuture.of(handle).then(lambda future: future.value().to(buffer.dtype))


def fp16_compress_hook(bucket: GradBucket) -> HookFuture:
    """Average the bucket as float16 (half the bytes of float32), cast back to its dtype: DDP's hook of
    that name, and hora's ``Compression.fp16`` (a gradient above 65504 becomes inf)."""
    return _cast_hook(bucket, torch.float16)


def bf16_compress_hook(bucket: GradBucket) -> HookFuture:
    """Average the bucket as bfloat16 (float32's range, 8 significant bits), cast back to its dtype."""
    return _cast_hook(bucket, torch.bfloat16)
