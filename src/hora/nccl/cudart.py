"""The CUDA runtime calls the device path needs, through ctypes: the seam between hora's logic and the GPU.

hora needs only streams, events, device memory and asynchronous copies; it never launches a kernel
of its own (scaling runs inside NCCL as a pre-multiplied Sum). hora's own waits on the GPU ask
``cudaEventQuery`` (:meth:`CudaApi.event_query`) in a loop with a deadline rather than block in
``cudaEventSynchronize``: an NCCL kernel whose peer died never finishes, and a wait that cannot end
would hide that from the code that can abort it (see :mod:`hora.nccl.ops`). :class:`CudaApi` names
those calls; :class:`CudaRuntime` makes them on ``libcudart`` (the one the process already loaded, a
CUDA 13 or 12 runtime wheel matching NCCL's, or the system's: :mod:`hora.nccl.loader`), and tests
drive :mod:`hora.nccl.ops` through a recording implementation of the same protocol, so the ordering
logic is checked on machines without a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

from hora.errors import HoraError
from hora.nccl import loader

LIBRARY_KNOB = "cudart_library"  # the config knob HORA_CUDART_LIBRARY sets
LIBRARY_ENV = "HORA_CUDART_LIBRARY"
# cudaMemcpyKind
DEVICE_TO_HOST = 2
HOST_TO_DEVICE = 1
DEVICE_TO_DEVICE = 3
# cudaErrorNotReady: what cudaEventQuery returns for an event whose work is still pending.
_NOT_READY = 600
# cudaEventDisableTiming: events used only for ordering are cheaper without timestamps.
_EVENT_DISABLE_TIMING = 2
# cudaStreamNonBlocking: hora's stream does not synchronise with the legacy default stream.
_STREAM_NON_BLOCKING = 1


class CudaError(HoraError):
    """A CUDA runtime call failed; the message names the call and CUDA's explanation."""


class CudaApi(Protocol):
    """What :mod:`hora.nccl.ops` asks of CUDA. Streams, events and pointers are plain ints."""

    def set_device(self, device: int) -> None: ...
    def stream_create(self) -> int: ...
    def event_create(self) -> int: ...
    def event_record(self, event: int, stream: int) -> None: ...
    def stream_wait_event(self, stream: int, event: int) -> None: ...
    def event_synchronize(self, event: int) -> None: ...
    def event_query(self, event: int) -> bool: ...
    def malloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None: ...
    def pointer_device(self, ptr: int) -> int: ...


def candidate_paths() -> list[str]:
    """Where libcudart may be, in the order tried (see :mod:`hora.nccl.loader`): the env override, a runtime
    already loaded into this process, the runtime wheels and then the system's names, each with the CUDA
    major that matches NCCL's first."""
    return [candidate.path for step in loader.cudart_steps() for candidate in step.candidates]


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The loaded runtime and its file, or ``(None, reason)``; searched once per process by the loader."""
    return loader.cudart_search().outcome()


def runtime_installed() -> bool:
    """Whether libcudart loads (``cuda_built()``)."""
    return _load()[0] is not None


def cuda_status() -> tuple[bool, str]:
    """Whether a CUDA device is usable, and why not: no runtime, no driver, or no device."""
    lib, where = _load()
    if lib is None:
        return False, where
    count = ctypes.c_int()
    result = lib.cudaGetDeviceCount(ctypes.byref(count))
    if result != 0:
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        return False, f"CUDA unusable: {lib.cudaGetErrorString(result).decode()} (cudaError {result})"
    if count.value == 0:
        return False, "CUDA sees no GPU"
    return True, f"{count.value} CUDA device(s) visible"


class CudaRuntime:
    """:class:`CudaApi` on libcudart."""

    def __init__(self) -> None:
        lib, where = _load()
        if lib is None:
            raise CudaError(where)
        self.lib = lib
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self.lib.cudaEventSynchronize.argtypes = [ctypes.c_void_p]
        self.lib.cudaEventQuery.argtypes = [ctypes.c_void_p]
        self.lib.cudaFree.argtypes = [ctypes.c_void_p]
        self.lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                             ctypes.c_void_p]

    def _check(self, call: str, result: int) -> None:
        if result != 0:
            raise CudaError(f"{call} failed: {self.lib.cudaGetErrorString(result).decode()} (cudaError {result})")

    def set_device(self, device: int) -> None:
        self._check("cudaSetDevice", self.lib.cudaSetDevice(device))

    def stream_create(self) -> int:
        stream = ctypes.c_void_p()
        self._check("cudaStreamCreateWithFlags",
                    self.lib.cudaStreamCreateWithFlags(ctypes.byref(stream), _STREAM_NON_BLOCKING))
        return stream.value or 0

    def event_create(self) -> int:
        event = ctypes.c_void_p()
        self._check("cudaEventCreateWithFlags",
                    self.lib.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING))
        return event.value or 0

    def event_record(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self.lib.cudaEventRecord(event, stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("cudaStreamWaitEvent", self.lib.cudaStreamWaitEvent(stream, event, 0))

    def event_synchronize(self, event: int) -> None:
        self._check("cudaEventSynchronize", self.lib.cudaEventSynchronize(event))

    def event_query(self, event: int) -> bool:
        """Whether the work before ``event`` is done (``cudaEventQuery``); never waits. A failure of
        that work (or a sticky CUDA error) raises :class:`CudaError`."""
        result = self.lib.cudaEventQuery(event)
        if result == _NOT_READY:
            return False
        self._check("cudaEventQuery", result)
        return True

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check("cudaMalloc", self.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1))))
        return ptr.value or 0

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self.lib.cudaFree(ptr))

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._check("cudaMemcpyAsync", self.lib.cudaMemcpyAsync(dst, src, nbytes, kind, stream))

    def pointer_device(self, ptr: int) -> int:
        """The device that owns ``ptr`` (``cudaPointerGetAttributes``; the struct's second int)."""
        attrs = (ctypes.c_int * 8)()
        self._check("cudaPointerGetAttributes",
                    self.lib.cudaPointerGetAttributes(attrs, ctypes.c_void_p(ptr)))
        return attrs[1]
