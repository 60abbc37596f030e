"""CUDA torch tensors onto NCCL: what hora.torch adds to the shared rule in :mod:`hora.device_requests`.

torch supplies the two things the shared rule cannot know: the current CUDA stream of the tensor's
device (hora's collectives are ordered after it, and it waits for them, so the caller never waits
on the host for a result it only chains on) and ``torch.empty`` for results whose shape negotiation
decides. A CPU tensor is recognised by ``tensor.is_cuda`` alone and never reaches NCCL.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

from hora import device_requests as submit
from hora.basics import ProcessSet
from hora.engine.request import Kind, Request
from hora.nccl.device_tensor import DL_CUDA, DeviceBuffer


def cuda_request(kind: Kind, tensor: torch.Tensor, name: str | None, process_set: ProcessSet,
                 inplace: bool = False, **fields: Any) -> Request | None:
    """The device-path request of a CUDA tensor, or None (a CPU tensor, or one NCCL cannot carry:
    it then takes the host path, copied through host memory)."""
    if not tensor.is_cuda or tensor.is_sparse:
        return None
    stream = torch.cuda.current_stream(tensor.device).cuda_stream
    source = tensor if inplace else tensor.detach()
    if not inplace and not source.is_contiguous():
        source = source.contiguous()

    def allocate(shape: tuple[int, ...]) -> tuple[torch.Tensor, DeviceBuffer]:
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        out_buffer = buffer_of(out, stream)
        assert out_buffer is not None  # the input's dtype, which buffer_of took below
        return out, out_buffer

    buffer = buffer_of(source, stream)
    if buffer is None:  # a dtype NCCL has no type for: the host path
        return None
    return submit.cuda_request(kind, source, name, process_set, inplace=inplace, stream=stream,
                               allocate=allocate, buffer=buffer, **fields)


_NUMPY_DTYPES = {
    torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64), torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
    torch.bool: np.dtype(np.bool_),
}


def buffer_of(tensor: torch.Tensor, stream: int | None) -> DeviceBuffer | None:
    """The tensor's device buffer read from torch itself (its pointer, device and layout).

    Not DLPack: torch refuses to export a tensor that requires grad (a parameter), and hora orders
    its stream after the framework's with events of its own, so DLPack's stream handshake would be
    a second, redundant synchronisation.
    """
    dtype = _NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        return None
    return DeviceBuffer(ptr=tensor.data_ptr(), device_type=DL_CUDA, device_id=int(tensor.device.index or 0),
                        dtype=dtype, shape=tuple(tensor.shape), contiguous=tensor.is_contiguous(),
                        stream=stream, keepalive=tensor)
