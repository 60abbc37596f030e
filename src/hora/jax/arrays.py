"""jax.Arrays as the engine's NumPy buffers (hora.jax's :class:`hora.binding.Adapter`), and the line
between the eager path and the jit path.

hora's engine reduces host (NumPy) buffers, or CUDA buffers through NCCL (:mod:`hora.jax.device`
decides which for a GPU array). Outside ``jax.jit`` a jax.Array on a CPU device is read as NumPy
(``np.asarray``, no copy for a single-device CPU array). An array on one accelerator that does not
take the NCCL path (``HORA_NCCL=off``, NCCL not installed, a dtype NCCL lacks, a TPU) is copied
through host memory (``jax.device_get``), as hora.torch copies such CUDA tensors. Every result comes
back where its input lived: on the input's device(s), with its sharding, when the input was placed
there explicitly (committed) or lives on an accelerator, else on the default device.

An array split over several devices (sharded, not replicated) has no single buffer that is "this
rank's tensor": it is refused here, naming the rank, host and devices, rather than gathered
silently. Inside ``jax.jit`` the operands are tracers; :mod:`hora.jax.mpi_ops` then runs the
collective in a host callback, to which XLA hands host copies itself.
"""

from __future__ import annotations

import socket
from typing import Any, NoReturn

import jax
import numpy as np

from hora import basics
from hora.transport.base import SUPPORTED_DTYPES

HOST_PLATFORM = "cpu"
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def is_traced(x: Any) -> bool:
    """Whether ``x`` is an abstract value being traced (inside jit, grad, vmap, ...)."""
    return isinstance(x, jax.core.Tracer)


def is_concrete(x: Any) -> bool:
    """Whether ``x`` is a jax.Array with a value (not a tracer): one whose placement matters."""
    return isinstance(x, jax.Array) and not is_traced(x)


def where() -> str:
    """``rank N on HOST``, for the messages of hora.jax's errors."""
    rank = basics.rank() if basics.is_initialized() else "?"
    return f"rank {rank} on {socket.gethostname()}"


def on_accelerator(x: Any) -> bool:
    """Whether ``x`` is a concrete jax.Array with a buffer outside host memory (GPU, TPU, ...)."""
    return is_concrete(x) and any(d.platform != HOST_PLATFORM for d in x.sharding.device_set)


def check_device(x: Any) -> None:
    """Refuse a jax.Array split over several devices (see the module docstring); any other array,
    on the host or on one accelerator (or replicated), is fine."""
    if not is_concrete(x):
        return
    devices = x.sharding.device_set
    if len(devices) > 1 and not x.is_fully_replicated:
        raise ValueError(
            f"hora.jax ({where()}): the array is sharded over {len(devices)} devices ({x.sharding}); "
            f"a collective needs one buffer per rank (hora runs one process per device, as Horovod does). "
            f"Gather it first (jax.device_get), or pass one shard (x.addressable_shards[i].data)")


def check_dtype(tensor: Any) -> None:
    """Refuse, naming the rank, an array split over several devices (:func:`check_device`) or of a dtype
    the engine lacks (float8, complex, ...), before anything is submitted."""
    check_device(tensor)
    dtype = np.dtype(tensor.dtype) if hasattr(tensor, "dtype") else np.asarray(tensor).dtype
    if dtype not in _SUPPORTED:
        raise TypeError(f"hora.jax ({where()}): the array has dtype {dtype}, which hora does not support; "
                        f"supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}")


def to_host(tensor: Any) -> np.ndarray:
    """``tensor`` (a jax.Array, NumPy array or scalar) as a NumPy array, after :func:`check_dtype`:
    a view of a CPU array, a copy of an accelerator's (``jax.device_get``)."""
    check_dtype(tensor)
    if on_accelerator(tensor):
        return np.asarray(jax.device_get(tensor))
    return np.asarray(tensor)


def new_like(array: np.ndarray, like: Any = None) -> jax.Array:
    """A jax.Array holding ``array``, with its dtype: where ``like`` (the collective's input) lives
    when it was placed explicitly or is on an accelerator, else on the default device."""
    if is_concrete(like) and (like.committed or on_accelerator(like)):
        return jax.device_put(np.asarray(array, dtype=array.dtype), like.sharding)
    return jax.numpy.asarray(array, dtype=array.dtype)


def write_into(tensor: Any, array: np.ndarray) -> NoReturn:
    """jax arrays are immutable, which is why hora.jax has no in-place forms (``allreduce_``, ...):
    refused, pointing at :func:`new_like`'s kind of result."""
    raise TypeError(f"hora.jax ({where()}): jax arrays are immutable and cannot be written in place; "
                    f"use the collective's result (a new array)")


def spec(x: Any, shape: tuple | None = None) -> jax.ShapeDtypeStruct:
    """What a callback returns for ``x``: its dtype, with ``shape`` (default: its own shape)."""
    return jax.ShapeDtypeStruct(tuple(x.shape) if shape is None else tuple(shape), x.dtype)
