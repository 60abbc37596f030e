"""GPU jax.Arrays onto NCCL: what hora.jax adds to the shared rule in :mod:`hora.device_requests`.

A jax.Array on one CUDA device is read in place through DLPack (``x.__dlpack__()``: its pointer,
no host copy) and submitted as a device request; :mod:`hora.device_requests` then decides, as for every
binding, whether NCCL carries it (``HORA_NCCL``, the dtype, the op) or it takes the host path.

JAX differs from torch in three ways that shape this module:

- No user-visible stream. hora passes none, so the executor waits on the host until hora's stream
  is done before it completes the handle: a result is complete when the caller gets it. On the way
  in, ``__dlpack__()`` without a stream waits until the array's producer has finished.
- Immutable arrays. Every result is a new jax.Array that jax allocates (``jnp.empty`` on the input's
  device and memory kind, so it comes from jax's own memory pool, which preallocates most of the
  GPU), and NCCL writes into it before anyone else has seen it. hora never hands jax memory of its
  own, so no ``jax.dlpack.from_dlpack`` is needed on the way back.
- JAX's calls may depend on the thread (``jax.enable_x64`` is thread-local) and its GPU queue may be
  stopped by a hora host callback of a jitted step. So a result whose shape is the input's
  (allreduce, broadcast) is made in the caller's thread when the request is built; only the results
  whose shape negotiation decides (allgather, alltoall, reducescatter) are made by the engine.

Where the array is decided from the jax device alone (:func:`dl_device_type`), never from its data,
so a CPU job never loads CUDA or NCCL. Arrays over several devices never come here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from hora import device_requests as submit
from hora.basics import ProcessSet
from hora.engine.request import Kind, Request
from hora.jax.arrays import is_concrete, where
from hora.nccl.device_tensor import DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED, DL_ROCM, DeviceBuffer, from_dlpack

_CUDA_KINDS = (DL_CUDA, DL_CUDA_MANAGED)
#: A platform DLPack has no device type for (TPU, ...): such arrays take the host path.
DL_NONE = 0
#: jax memory kinds in the accelerator's own memory (None: the platform has only one kind).
_DEVICE_MEMORY = (None, "device")
#: Results with the input's shape: made in the caller's thread (see the module docstring).
_SAME_SHAPE = (Kind.ALLREDUCE, Kind.BROADCAST)


def dl_device_type(platform: str, platform_version: str = "", memory_kind: str | None = None) -> int:
    """The DLPack device type of memory on a jax device: its ``platform`` (``'gpu'`` for CUDA and
    ROCm devices in jax, ``'cuda'``/``'rocm'`` as jax spells backends), the backend's
    ``platform_version`` (``'cuda 13000'``, ``'rocm 6.2'``) and the array's ``memory_kind``
    (``'pinned_host'`` is host memory the GPU can reach, not the GPU's own). As jax's own
    ``__dlpack_device__`` decides it, but also for what DLPack cannot name (a TPU: :data:`DL_NONE`)."""
    if platform == "cpu":
        return DL_CPU
    if platform not in ("gpu", "cuda", "rocm"):
        return DL_NONE
    if platform == "rocm" or "rocm" in platform_version.lower():
        return DL_ROCM
    return DL_CUDA if memory_kind in _DEVICE_MEMORY else DL_CUDA_HOST


def dlpack_device(array: jax.Array) -> tuple[int, int]:
    """``(DLPack device type, device id)`` of a single-device array, read from its jax device.

    The one place hora.jax learns where an array lives: the tests replace it to send CPU arrays
    down the device path through the emulated NCCL (tests/nccl/nccl_emulation.py).
    """
    (device,) = array.sharding.device_set
    kind = dl_device_type(device.platform, device.client.platform_version, array.sharding.memory_kind)
    index = getattr(device, "local_hardware_id", None)
    return kind, int(device.id if index is None else index)


def is_cuda(x: Any) -> bool:
    """Whether ``x`` is a concrete jax.Array on one CUDA device (in its own memory)."""
    return is_concrete(x) and len(x.sharding.device_set) == 1 and dlpack_device(x)[0] in _CUDA_KINDS


def device_buffer(array: jax.Array) -> DeviceBuffer:
    """``array``'s device memory through DLPack, in place (the capsule and the array are kept alive
    with it). Device and dtype are jax's: jax's word is what chose the path, and some jax versions
    export bool as uint8."""
    kind, index = dlpack_device(array)
    buffer = from_dlpack(array)  # stream None: waits until the array's producer has finished
    return dataclasses.replace(buffer, device_type=kind, device_id=index, dtype=np.dtype(array.dtype))


class Allocator(submit.PreparedAllocator):
    """New jax.Arrays for results, on the input's device and memory kind, with their buffers."""

    def __init__(self, like: jax.Array) -> None:
        super().__init__(tuple(like.shape))
        self.sharding = like.sharding
        self.dtype = np.dtype(like.dtype)

    def _make(self, shape: tuple[int, ...]) -> tuple[jax.Array, DeviceBuffer]:
        out = jax.numpy.empty(shape, self.dtype, device=self.sharding)
        if np.dtype(out.dtype) != self.dtype or tuple(out.shape) != shape:
            # NCCL would write past the end of a narrower array: refuse instead
            raise TypeError(f"hora.jax ({where()}): jax made the {self.dtype} result as {out.dtype} {out.shape} "
                            f"in this thread (jax.enable_x64 is thread-local); enable 64-bit types for the "
                            f"process (JAX_ENABLE_X64=1) or use a 32-bit dtype")
        return out, device_buffer(out)


def cuda_request(kind: Kind, array: Any, name: str | None, process_set: ProcessSet,
                 **fields: Any) -> Request | None:
    """The device-path request of a jax.Array on one CUDA device, or None: any other array, or one
    NCCL cannot carry here (it then goes through host memory). ``HORA_NCCL=require`` makes the
    latter an error naming why (:mod:`hora.nccl.path`)."""
    if not is_cuda(array):
        return None
    allocate = Allocator(array)
    request = submit.cuda_request(kind, array, name, process_set, stream=None, allocate=allocate,
                                  buffer=device_buffer(array), **fields)
    if request is not None and kind in _SAME_SHAPE:
        allocate.prepare()
    return request
