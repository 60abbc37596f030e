"""Any framework's tensor as a :class:`DeviceBuffer`: address, device, dtype, shape, and the producer's stream.

Two standard protocols describe a tensor's memory without copying it, and every framework hora
binds speaks at least one:

- DLPack (torch, TensorFlow through ``tf.experimental.dlpack``, JAX, CuPy, NumPy): ``__dlpack__()``
  returns a capsule holding a ``DLManagedTensor``. It is read here with ctypes, without consuming
  it, so the producer keeps ownership and frees the memory as usual.
- ``__cuda_array_interface__`` (CuPy, torch, Numba, JAX arrays): a dict with the address, shape,
  ``typestr``, strides and the producer's stream.

The reader is pure Python and works on CPU tensors as well, which is what lets the path choice and
the plumbing be tested on machines without a GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

# DLDeviceType values (dlpack.h).
DL_CPU = 1
DL_CUDA = 2
DL_CUDA_HOST = 3
DL_ROCM = 10
DL_CUDA_MANAGED = 13
_CUDA_DEVICE_TYPES = (DL_CUDA, DL_CUDA_MANAGED)
# DLDataTypeCode values.
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):  # DLPack >= 1.0: "dltensor_versioned" capsules
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


@dataclass
class DeviceBuffer:
    """Where a tensor's elements are, and how to order work after whoever produced them.

    ``stream`` is the producer's CUDA stream when the protocol says it (``__cuda_array_interface__``
    v3), else None (the caller passes its framework's current stream). ``keepalive`` holds the
    DLPack capsule or the tensor itself, so the memory outlives the collective.
    """

    ptr: int
    device_type: int
    device_id: int
    dtype: np.dtype
    shape: tuple[int, ...]
    contiguous: bool
    stream: int | None = None
    keepalive: Any = field(default=None, repr=False)

    @property
    def on_cuda(self) -> bool:
        return self.device_type in _CUDA_DEVICE_TYPES

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def _dl_dtype(code: int, bits: int, lanes: int) -> np.dtype:
    if lanes != 1:
        raise TypeError(f"DLPack vector types (lanes={lanes}) are not supported")
    if code == _DL_BFLOAT and bits == 16:
        return np.dtype(ml_dtypes.bfloat16)
    if code == _DL_BOOL:
        return np.dtype(np.bool_)
    kind = {_DL_INT: "i", _DL_UINT: "u", _DL_FLOAT: "f"}.get(code)
    if kind is None:
        raise TypeError(f"DLPack dtype code {code} ({bits} bits) is not supported")
    return np.dtype(f"{kind}{bits // 8}")


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    if strides is None:
        return True
    # extents of 1 may carry any stride
    return all(extent == 1 or got == want for extent, got, want in zip(shape, strides, row_major_strides(shape)))


def from_dlpack_capsule(capsule: Any) -> DeviceBuffer:
    """Read a ``dltensor`` / ``dltensor_versioned`` capsule (not consuming it: its producer still frees it)."""
    name = _capsule_name(capsule)
    if name not in (b"dltensor", b"dltensor_versioned"):
        raise ValueError(f"not an unconsumed DLPack capsule (its name is {name!r})")
    address = _capsule_pointer(capsule, name)
    managed_type = _DLManagedTensorVersioned if name == b"dltensor_versioned" else _DLManagedTensor
    tensor = managed_type.from_address(address).dl_tensor
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = tuple(tensor.strides[i] for i in range(tensor.ndim)) if tensor.strides else None
    dtype = _dl_dtype(tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    return DeviceBuffer(ptr=(tensor.data or 0) + tensor.byte_offset, device_type=tensor.device.device_type,
                        device_id=tensor.device.device_id, dtype=dtype, shape=shape,
                        contiguous=_is_contiguous(shape, strides), keepalive=capsule)


def from_dlpack(tensor: Any, stream: int | None = None) -> DeviceBuffer:
    """A tensor's buffer through ``__dlpack__``.

    For a CUDA tensor ``stream`` is the consumer's (hora's) stream: by the DLPack protocol the
    producer then orders its pending work before that stream (torch records an event and makes
    the stream wait), so no host wait is needed.
    """
    if stream is not None:
        capsule = tensor.__dlpack__(stream=stream)
    else:
        capsule = tensor.__dlpack__()
    buf = from_dlpack_capsule(capsule)
    buf.keepalive = (capsule, tensor)
    return buf


def from_cuda_array_interface(tensor: Any) -> DeviceBuffer:
    """A tensor's buffer through ``__cuda_array_interface__`` (versions 2 and 3).

    The interface does not name the device; ``device_id`` is -1 until the CUDA runtime resolves the
    pointer (:meth:`hora.nccl.cudart.CudaApi.pointer_device`). Stream 1 and 2 are CUDA's legacy and
    per-thread default streams, kept as given.
    """
    desc = tensor.__cuda_array_interface__
    if desc.get("mask") is not None:
        raise TypeError("masked __cuda_array_interface__ arrays are not supported")
    shape = tuple(int(n) for n in desc["shape"])
    dtype = np.dtype(desc["typestr"])
    byte_strides = desc.get("strides")
    strides = None if byte_strides is None else tuple(s // dtype.itemsize for s in byte_strides)
    ptr, _readonly = desc["data"]
    return DeviceBuffer(ptr=int(ptr or 0), device_type=DL_CUDA, device_id=-1, dtype=dtype, shape=shape,
                        contiguous=_is_contiguous(shape, strides), stream=desc.get("stream"), keepalive=tensor)


def device_of(tensor: Any) -> tuple[int, int]:
    """``(DLPack device type, device id)`` of any tensor, without reading its data.

    ``__dlpack_device__`` first (every DLPack producer has it), then ``__cuda_array_interface__``
    (CUDA by definition), then torch's ``.device``; anything else (NumPy, Python lists) is CPU.
    """
    if hasattr(tensor, "__dlpack_device__"):
        kind, index = tensor.__dlpack_device__()
        return int(kind), int(index)
    if hasattr(tensor, "__cuda_array_interface__"):
        return DL_CUDA, -1
    device: Any = getattr(tensor, "device", None)  # a framework's device object, if any
    if getattr(device, "type", None) == "cuda":
        return DL_CUDA, int(device.index or 0)
    return DL_CPU, 0


def describe(tensor: Any, stream: int | None = None) -> DeviceBuffer:
    """The tensor's buffer, by whichever protocol it speaks (DLPack preferred: it carries the device)."""
    if hasattr(tensor, "__dlpack__"):
        return from_dlpack(tensor, stream)
    if hasattr(tensor, "__cuda_array_interface__"):
        return from_cuda_array_interface(tensor)
    raise TypeError(f"{type(tensor).__name__} speaks neither DLPack nor __cuda_array_interface__")
