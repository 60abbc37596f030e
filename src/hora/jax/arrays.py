"""jax.Arrays as the engine's NumPy buffers, and the line between the eager path and the jit path.

hora's engine reduces host (NumPy) buffers. Outside ``jax.jit`` a jax.Array on a CPU device is
read as NumPy (``np.asarray``, no copy for a single-device CPU array) and the result comes back with
``jnp.asarray``. Arrays that live on an accelerator, or are split over several devices, have no
single host buffer that is "this rank's tensor": they are refused here, naming the rank and host,
instead of being copied silently. Inside ``jax.jit`` the operands are tracers; :mod:`hora.jax.mpi_ops`
then runs the collective in a host callback, to which XLA hands host copies itself.
"""

from __future__ import annotations

import socket
from typing import Any

import jax
import numpy as np

from hora import basics

SUPPORTED_PLATFORMS = frozenset({"cpu"})


def is_traced(x: Any) -> bool:
    """Whether ``x`` is an abstract value being traced (inside jit, grad, vmap, ...)."""
    return isinstance(x, jax.core.Tracer)


def _where() -> str:
    rank = basics.rank() if basics.is_initialized() else "?"
    return f"rank {rank} on {socket.gethostname()}"


def check_device(x: Any) -> None:
    """Refuse a jax.Array that is not one buffer in host memory (see the module docstring)."""
    if not isinstance(x, jax.Array) or is_traced(x):
        return
    devices = x.sharding.device_set
    platforms = sorted({d.platform for d in devices})
    if not set(platforms) <= SUPPORTED_PLATFORMS:
        raise ValueError(
            f"hora.jax ({_where()}): the array is on {', '.join(platforms)} device(s) {sorted(map(str, devices))}; "
            f"hora.jax's collectives run on host (CPU) buffers. Move it first with "
            f"jax.device_put(x, jax.devices('cpu')[0]), or call the collective inside jax.jit, where XLA "
            f"copies the operand to the host for hora's callback")
    if len(devices) > 1 and not x.is_fully_replicated:
        raise ValueError(
            f"hora.jax ({_where()}): the array is sharded over {len(devices)} devices ({x.sharding}); "
            f"a collective needs one buffer per rank. Gather it first (jax.device_get) or pass one shard")


def host_array(x: Any) -> np.ndarray:
    """``x`` (a jax.Array, NumPy array or scalar) as a NumPy array, after :func:`check_device`."""
    check_device(x)
    return np.asarray(x)


def to_jax(array: np.ndarray) -> jax.Array:
    """A jax.Array holding ``array``, with its dtype (on the default device)."""
    return jax.numpy.asarray(array, dtype=array.dtype)


def spec(x: Any, shape: tuple | None = None) -> jax.ShapeDtypeStruct:
    """What a callback returns for ``x``: its dtype, with ``shape`` (default: its own shape)."""
    return jax.ShapeDtypeStruct(tuple(x.shape) if shape is None else tuple(shape), x.dtype)
