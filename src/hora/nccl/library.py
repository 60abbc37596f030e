"""The NCCL library through ctypes: finding it, its version, and typed entry points.

hora binds NCCL directly with ctypes rather than through a compiled extension: the library is the
``nvidia-nccl-cu13`` or ``-cu12`` wheel's ``libnccl.so.2`` (the wheels PyTorch's CUDA builds depend
on, so a GPU install of torch already has one), an NCCL the process already loaded, or a system NCCL
(:mod:`hora.nccl.loader` has the order; ``HORA_NCCL_LIBRARY`` names a file explicitly, a site NCCL
build, say). ``ncclGetVersion`` and ``ncclGetUniqueId`` need no GPU, so :func:`nccl_version` (and
``nccl_built()``) report the real version on a CPU-only machine whenever the library is installed.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any

import numpy as np

from hora.errors import HoraError
from hora.nccl import loader
from hora.transport.base import ReduceOp

#: ``NCCL_UNIQUE_ID_BYTES`` in nccl.h.
UNIQUE_ID_BYTES = 128
LIBRARY_KNOB = "nccl_library"  # the config knob HORA_NCCL_LIBRARY sets
LIBRARY_ENV = "HORA_NCCL_LIBRARY"


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: a struct that ``ncclCommInitRank`` takes by value. A bare ``c_char * 128`` in
    ``argtypes`` would be passed as a pointer (ctypes decays arrays), and NCCL would read its id from
    whatever the stack held: "invalid argument" on a real GPU."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class NcclUnavailable(HoraError):
    """NCCL cannot be used here (not installed, or its library does not load); the message says why."""


#: ``ncclInvalidUsage``: among others, ``ncclCommInitRank``'s answer to two ranks of one communicator on one GPU.
INVALID_USAGE = 5


class NcclError(HoraError):
    """An NCCL call failed; the message names the call and NCCL's own explanation, ``result`` its
    ``ncclResult_t`` (0 where unknown, as after the error travelled to another process)."""

    def __init__(self, message: str, result: int = 0) -> None:
        super().__init__(message)
        self.result = result


class DataType(enum.IntEnum):
    """``ncclDataType_t``."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9


class RedOp(enum.IntEnum):
    """``ncclRedOp_t`` (built-in ops; ``ncclRedOpCreatePreMulSum`` makes further ones)."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


# NumPy dtype names (ml_dtypes' bfloat16 included) -> NCCL types. bool travels as uint8: a Sum of
# booleans then overflows past 1, so the path chooser keeps bool allreduces on the host.
_DTYPES = {
    "int8": DataType.INT8, "uint8": DataType.UINT8, "bool": DataType.UINT8, "int32": DataType.INT32,
    "uint32": DataType.UINT32, "int64": DataType.INT64, "uint64": DataType.UINT64,
    "float16": DataType.FLOAT16, "float32": DataType.FLOAT32, "float64": DataType.FLOAT64,
    "bfloat16": DataType.BFLOAT16,
}
_OPS = {ReduceOp.SUM: RedOp.SUM, ReduceOp.PRODUCT: RedOp.PROD, ReduceOp.MAX: RedOp.MAX, ReduceOp.MIN: RedOp.MIN}


def nccl_dtype(dtype: np.dtype | str) -> DataType:
    """The NCCL type of a NumPy dtype; TypeError naming the dtype when NCCL has none (int16, say)."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    try:
        return _DTYPES[name]
    except KeyError:
        raise TypeError(f"NCCL has no data type for {name}; such tensors take the host path") from None


def nccl_op(op: ReduceOp) -> RedOp:
    """The NCCL reduction of an elementwise hora op (AVERAGE arrives here as SUM plus a scale)."""
    try:
        return _OPS[ReduceOp(op)]
    except KeyError:
        raise ValueError(f"NCCL has no reduction for {ReduceOp(op).name}") from None


def candidate_paths() -> list[str]:
    """Where libnccl may be, in the order tried (see :mod:`hora.nccl.loader`): the env override, the NVIDIA
    wheel, an NCCL a framework already loaded into this process, the system loader."""
    return [candidate.path for step in loader.nccl_steps() for candidate in step.candidates]


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library and its file, or ``(None, reason)``; searched once per process by the loader."""
    return loader.nccl_search().outcome()


def load() -> ctypes.CDLL:
    """The NCCL library, or :class:`NcclUnavailable` saying what was tried."""
    lib, where = _load()
    if lib is None:
        raise NcclUnavailable(where)
    return lib


def library_path() -> str | None:
    """The file of the NCCL this process uses (the dynamic loader's choice, where a bare name was asked for)."""
    lib, where = _load()
    return where if lib is not None else None


def decode_version(code: int) -> str:
    """``23203`` -> ``"2.32.3"`` (NCCL >= 2.9 codes major*10000 + minor*100 + patch)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def nccl_version() -> int:
    """NCCL's version code (``ncclGetVersion``), or 0 when no NCCL library loads. Needs no GPU."""
    lib, _ = _load()
    if lib is None:
        return 0
    code = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return 0
    return code.value


def nccl_status() -> tuple[bool, str]:
    """Whether the device path can run here, and why (or why not), for ``hora check``."""
    code = nccl_version()
    if not code:
        lib, where = _load()
        return False, where if lib is None else f"{where}: ncclGetVersion failed (not an NCCL library?)"
    from hora.nccl import cudart

    usable, why = cudart.cuda_status()
    where = f"NCCL {decode_version(code)} from {library_path()}"
    return usable, f"{where}; {why}"


class Nccl:
    """Typed NCCL calls; each raises :class:`NcclError` with NCCL's message when it fails.

    Pointers and handles are plain ints (device addresses, ``cudaStream_t``, ``ncclComm_t``), the
    currency of DLPack and ``__cuda_array_interface__``.
    """

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self.lib = lib if lib is not None else load()
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        for name in ("ncclAllReduce", "ncclReduceScatter"):
            getattr(self.lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ncclAllGather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ncclReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        for name in ("ncclSend", "ncclRecv"):
            getattr(self.lib, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                                ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ncclRedOpCreatePreMulSum.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                      ctypes.c_void_p]
        self.lib.ncclRedOpDestroy.argtypes = [ctypes.c_int, ctypes.c_void_p]
        self.lib.ncclCommInitRank.argtypes = [ctypes.c_void_p, ctypes.c_int, UniqueId, ctypes.c_int]
        for name in ("ncclCommDestroy", "ncclCommAbort"):
            getattr(self.lib, name).argtypes = [ctypes.c_void_p]
        self.lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]

    def _check(self, call: str, result: int) -> None:
        if result != 0:
            message = self.lib.ncclGetErrorString(result).decode(errors="replace")
            raise NcclError(f"{call} failed: {message} (ncclResult_t {result})", result)

    def version(self) -> int:
        code = ctypes.c_int()
        self._check("ncclGetVersion", self.lib.ncclGetVersion(ctypes.byref(code)))
        return code.value

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (128 bytes); rank 0 of a communicator makes it, the others receive it."""
        buf = ctypes.create_string_buffer(UNIQUE_ID_BYTES)
        self._check("ncclGetUniqueId", self.lib.ncclGetUniqueId(buf))
        return buf.raw

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        comm = ctypes.c_void_p()
        uid = UniqueId.from_buffer_copy(unique_id)
        self._check("ncclCommInitRank", self.lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank))
        return comm.value or 0

    def comm_destroy(self, comm: int) -> None:
        self._check("ncclCommDestroy", self.lib.ncclCommDestroy(comm))

    def comm_abort(self, comm: int) -> None:
        self._check("ncclCommAbort", self.lib.ncclCommAbort(comm))

    def comm_get_async_error(self, comm: int) -> int:
        """``ncclCommGetAsyncError``: 0 (ncclSuccess), 7 (ncclInProgress), else what broke the communicator."""
        result = ctypes.c_int()
        self._check("ncclCommGetAsyncError", self.lib.ncclCommGetAsyncError(comm, ctypes.byref(result)))
        return result.value

    def error_string(self, code: int) -> str:
        """NCCL's words for an ``ncclResult_t``."""
        return str(self.lib.ncclGetErrorString(code).decode(errors="replace"))

    def group_start(self) -> None:
        self._check("ncclGroupStart", self.lib.ncclGroupStart())

    def group_end(self) -> None:
        self._check("ncclGroupEnd", self.lib.ncclGroupEnd())

    def premul_sum(self, scale: float, dtype: DataType, comm: int) -> int:
        """A Sum that multiplies every input by ``scale`` first (``ncclRedOpCreatePreMulSum``, host scalar)."""
        op = ctypes.c_int()
        if dtype in (DataType.FLOAT64,):
            scalar: Any = ctypes.c_double(scale)
        elif dtype in (DataType.FLOAT32, DataType.FLOAT16, DataType.BFLOAT16):
            # half types take a float scalar of their own width; NCCL reads sizeof(type) bytes
            scalar = ctypes.c_float(scale) if dtype == DataType.FLOAT32 else ctypes.c_uint16(
                int(np.array(scale, dtype=np.float16 if dtype == DataType.FLOAT16 else _bf16()).view(np.uint16)))
        else:
            scalar = (ctypes.c_int64(int(scale)) if dtype in (DataType.INT64, DataType.UINT64)
                      else ctypes.c_int32(int(scale)))
        self._check("ncclRedOpCreatePreMulSum",
                    self.lib.ncclRedOpCreatePreMulSum(ctypes.byref(op), ctypes.byref(scalar), int(dtype), 1, comm))
        return op.value

    def op_destroy(self, op: int, comm: int) -> None:
        self._check("ncclRedOpDestroy", self.lib.ncclRedOpDestroy(op, comm))

    def all_reduce(self, send: int, recv: int, count: int, dtype: DataType, op: int, comm: int, stream: int) -> None:
        self._check("ncclAllReduce", self.lib.ncclAllReduce(send, recv, count, int(dtype), int(op), comm, stream))

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: DataType, op: int, comm: int,
                       stream: int) -> None:
        self._check("ncclReduceScatter",
                    self.lib.ncclReduceScatter(send, recv, count, int(dtype), int(op), comm, stream))

    def all_gather(self, send: int, recv: int, count: int, dtype: DataType, comm: int, stream: int) -> None:
        self._check("ncclAllGather", self.lib.ncclAllGather(send, recv, count, int(dtype), comm, stream))

    def broadcast(self, send: int, recv: int, count: int, dtype: DataType, root: int, comm: int, stream: int) -> None:
        self._check("ncclBroadcast", self.lib.ncclBroadcast(send, recv, count, int(dtype), root, comm, stream))

    def reduce(self, send: int, recv: int, count: int, dtype: DataType, op: int, root: int, comm: int,
               stream: int) -> None:
        self._check("ncclReduce", self.lib.ncclReduce(send, recv, count, int(dtype), int(op), root, comm, stream))

    def send(self, buf: int, count: int, dtype: DataType, peer: int, comm: int, stream: int) -> None:
        self._check("ncclSend", self.lib.ncclSend(buf, count, int(dtype), peer, comm, stream))

    def recv(self, buf: int, count: int, dtype: DataType, peer: int, comm: int, stream: int) -> None:
        self._check("ncclRecv", self.lib.ncclRecv(buf, count, int(dtype), peer, comm, stream))


def _bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16
