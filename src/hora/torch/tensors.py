"""Torch tensors as the engine's NumPy buffers, without copies where the memory layout allows: hora.torch's
:class:`hora.binding.Adapter`.

A contiguous CPU tensor shares its memory with the NumPy array the engine reduces, so an in-place
collective writes straight into the tensor. CUDA tensors take NCCL when it can carry them
(:mod:`hora.torch.device`); the rest (non-contiguous, or CUDA tensors with ``HORA_NCCL=off`` or no
usable NCCL) go through a host copy (``hora check`` says which).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

SUPPORTED = (
    torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
)


def check_dtype(tensor: torch.Tensor) -> None:
    """Refuse a non-tensor or a dtype the engine lacks before anything is submitted."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED)
        raise TypeError(f"tensor dtype {tensor.dtype} is not supported by hora; supported: {names}")


def shares_memory(tensor: torch.Tensor) -> bool:
    """Whether :func:`to_host` returns a view of ``tensor`` (not a copy)."""
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.is_sparse


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's data as a NumPy array: a view for contiguous CPU tensors, else a host copy."""
    check_dtype(tensor)
    # detach() only where numpy() needs it: each torch call that releases the GIL hands it to a
    # waiting engine thread, which costs more than the call.
    t = tensor.detach() if tensor.requires_grad else tensor
    if not shares_memory(t):
        t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def new_like(array: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor holding ``array`` (shared memory on CPU), moved to ``like``'s device if given."""
    # np.ascontiguousarray returns at least one dimension: keep 0-d results 0-d.
    contiguous = np.ascontiguousarray(array).reshape(array.shape)
    if array.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(contiguous.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(contiguous)
    if like is not None and like.device.type != "cpu":
        t = t.to(like.device)
    return t


def write_into(tensor: torch.Tensor, array: np.ndarray) -> torch.Tensor:
    """Copy ``array`` into ``tensor`` (on its device) and return ``tensor``: the in-place forms' result,
    where :func:`to_host` had to copy. Outside autograd, as Horovod's in-place collectives write."""
    with torch.no_grad():
        tensor.copy_(new_like(array, tensor))
    return tensor
