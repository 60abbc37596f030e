"""MXNet NDArrays as the engine's NumPy buffers: hora.mxnet's :class:`hora.binding.Adapter`.

hora's engine reduces NumPy arrays. An NDArray's memory belongs to MXNet's asynchronous engine, so
it is read with ``asnumpy()`` (which waits for the operations that write it) and results are
written back with ``nd[:] = array`` (which MXNet orders after every pending read). Horovod's MXNet
collectives take dense NDArrays only; a sparse one is refused here, on the calling rank, before
anything is submitted, so no peer is left waiting on a half-started collective.
"""

from __future__ import annotations

import socket

import mxnet as mx
import numpy as np

from hora import basics


def where() -> str:
    """'rank R on HOST' for error messages (just 'HOST' before init)."""
    try:
        return f"rank {basics.rank()} on {socket.gethostname()}"
    except ValueError:
        return socket.gethostname()


def check_dtype(tensor: mx.nd.NDArray, what: str = "collective") -> None:
    """Refuse anything but a dense NDArray with a TypeError/ValueError naming ``what`` (the operation)
    and the rank; dtypes are the engine's to refuse."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"hora.mxnet.{what} ({where()}): expected an mxnet NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise ValueError(f"hora.mxnet.{what} ({where()}): got a sparse NDArray (storage type {tensor.stype!r}); "
                         "Horovod's MXNet collectives take dense NDArrays only: pass tensor.tostype('default')")


def to_host(tensor: mx.nd.NDArray, what: str = "collective") -> np.ndarray:
    """A C-contiguous host copy of a dense NDArray (waits for MXNet to finish writing it)."""
    check_dtype(tensor, what)
    return np.ascontiguousarray(tensor.asnumpy())


def new_like(array: np.ndarray, like: mx.nd.NDArray) -> mx.nd.NDArray:
    """A new NDArray holding ``array``, on ``like``'s context.

    An empty NDArray filled by one host copy: ``mx.nd.array`` takes several times longer for the
    megabyte-sized gradients a trainer lands every step."""
    if array.ndim == 0 or array.size == 0:
        return mx.nd.array(array, ctx=like.context, dtype=array.dtype)
    out = mx.nd.empty(array.shape, ctx=like.context, dtype=array.dtype)
    out[:] = array
    return out


def write_into(tensor: mx.nd.NDArray, array: np.ndarray) -> mx.nd.NDArray:
    """Copy ``array`` into ``tensor`` in place and return ``tensor``.

    One host copy where MXNet allows it; MXNet's MKL-DNN build keeps convolution weights in its own
    memory layout, which refuses host copies, and those go through an NDArray (an engine copy)."""
    try:
        tensor[:] = array
    except mx.base.MXNetError:
        tensor[:] = new_like(array, tensor).astype(tensor.dtype, copy=False)
    return tensor
