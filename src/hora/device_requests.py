"""CUDA tensors into the engine: the one rule every binding follows for the device path.

A binding asks :func:`cuda_request` for any tensor that may live on a GPU. It returns None for a
tensor that takes the host path (a CPU tensor, or a CUDA tensor NCCL cannot carry, see
:mod:`hora.nccl.path`), and otherwise the engine :class:`Request` whose buffer is a
:class:`~hora.nccl.dispatch.DeviceTensor` and whose signature says ``device="cuda"``: ranks that chose
different paths then fail negotiation with a message naming both, instead of hanging in NCCL.

NumPy arrays never reach here (the generic API checks ``type(x) is np.ndarray`` first), and a CPU
tensor is recognised from its device alone, so CPU jobs never load CUDA or NCCL.
"""

from __future__ import annotations

import socket
from typing import Any

from hora import basics, config
from hora.basics import ProcessSet
from hora.engine.request import Handle, Kind, Request, dtype_name, signature
from hora.nccl import context
from hora.nccl.device_tensor import DL_CUDA, DL_CUDA_MANAGED, DeviceBuffer, describe, device_of
from hora.nccl.dispatch import Allocate, DeviceTensor, dtype_of
from hora.nccl.path import DEVICE, choose_path, parse_mode
from hora.transport.base import ReduceOp

_CUDA_KINDS = (DL_CUDA, DL_CUDA_MANAGED)
_REDUCING = (Kind.ALLREDUCE, Kind.REDUCESCATTER)
#: Results whose shape negotiation decides: they always need a new tensor.
_ALLOCATING = (Kind.ALLGATHER, Kind.ALLTOALL, Kind.REDUCESCATTER)


def is_cuda(tensor: Any) -> bool:
    """Whether ``tensor`` lives in CUDA memory (reads its device, never its data)."""
    return device_of(tensor)[0] in _CUDA_KINDS


def array_api_allocator(tensor: Any) -> Allocate | None:
    """New tensors like ``tensor`` through its Array API namespace (CuPy has one), or None."""
    namespace_of = getattr(tensor, "__array_namespace__", None)
    if namespace_of is None:
        return None
    namespace = namespace_of()

    def allocate(shape: tuple[int, ...]) -> tuple[Any, DeviceBuffer]:
        out = namespace.empty(shape, dtype=tensor.dtype)
        return out, describe(out)

    return allocate


class PreparedAllocator:
    """Makes a stream-less framework's results (``hora.nccl.dispatch.Allocate``). The input-shaped one
    (allreduce, broadcast) can be made ahead in the caller's thread (:meth:`prepare`), where the
    framework's thread-local settings and the call's one device sync apply; results whose shape
    negotiation decides are made when the engine asks. A binding supplies :meth:`_make`."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self._ready: tuple[Any, DeviceBuffer] | None = None

    def prepare(self) -> None:
        self._ready = self._make(self.shape)

    def __call__(self, shape: tuple[int, ...]) -> tuple[Any, DeviceBuffer]:
        ready, self._ready = self._ready, None
        if ready is not None and tuple(shape) == self.shape:
            return ready
        return self._made_by_engine(self._make(tuple(shape)))

    def _made_by_engine(self, made: tuple[Any, DeviceBuffer]) -> tuple[Any, DeviceBuffer]:
        """A result made in the engine's thread, before NCCL writes into it."""
        return made

    def _make(self, shape: tuple[int, ...]) -> tuple[Any, DeviceBuffer]:
        raise NotImplementedError


def cuda_request(kind: Kind, tensor: Any, name: str | None, process_set: ProcessSet, *,
                 op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0, postscale: float = 1.0, root: int = -1,
                 splits: tuple[int, ...] = (), group: str = "", group_size: int = 0, inplace: bool = False,
                 stream: int | None = None, allocate: Allocate | None = None,
                 required: bool = False, buffer: DeviceBuffer | None = None) -> Request | None:
    """The device-path request for ``tensor``, or None when it takes the host path.

    ``stream`` is the framework's current stream (hora's collectives are ordered after it, and it
    waits for them); ``allocate`` makes a framework tensor for a new result (None: the tensor's
    Array API namespace). ``required`` (the generic API, which cannot copy a foreign CUDA array to
    host memory): a CUDA tensor that cannot take the device path is an error naming why. ``buffer``:
    the tensor's device buffer when the binding reads it natively (else DLPack or the CUDA array
    interface describe it).
    """
    reduces = kind in _REDUCING
    if buffer is not None:
        where, dtype = (buffer.device_type, buffer.device_id), buffer.dtype
    else:
        where, dtype = device_of(tensor), dtype_of(tensor)
    choice = choose_path(where, dtype, op if reduces else None, parse_mode(str(config.get("nccl"))), context.ready,
                         scaled=reduces and (prescale != 1.0 or postscale != 1.0))
    if choice.path != DEVICE:
        if required and is_cuda(tensor):
            raise TypeError(f"rank {basics.rank()} on {socket.gethostname()}: {choice.reason}; hora's generic "
                            "API takes NumPy arrays, or CUDA arrays when NCCL can carry them")
        return None
    if buffer is None:
        buffer = describe(tensor, stream)
    if not buffer.contiguous:
        if inplace or required:
            raise ValueError(f"rank {basics.rank()}: the CUDA tensor must be contiguous for an in-place "
                             f"{kind.value.lower()} on NCCL")
        return None  # the binding copies it through the host path
    allocate = allocate or array_api_allocator(tensor)
    if allocate is None and (kind in _ALLOCATING or not inplace):
        raise TypeError(f"rank {basics.rank()}: {type(tensor).__name__} has no Array API namespace to make the "
                        f"result of a {kind.value.lower()} in; use the in-place form or a CuPy/torch tensor")
    set_id = basics.process_set_id(process_set)
    if name is None:
        name = basics.engine().auto_name(kind.value, set_id)
    shape = tuple(buffer.shape)
    sig = signature(kind, dtype_name(buffer.dtype), shape, op if reduces else ReduceOp.SUM, root,
                    float(prescale), float(postscale), group, group_size, splits, device="cuda")
    device_tensor = DeviceTensor(tensor, buffer, stream, allocate, inplace)
    return Request(name, sig, device_tensor, Handle(name), set_id)
