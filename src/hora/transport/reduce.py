"""Element-wise reduction kernels shared by every host-memory transport.

Each kernel combines ``src`` into ``dst`` in place with one NumPy ufunc call, so the GIL is released
for the bulk of the work and a transport's network threads keep running while a chunk is reduced.
"""

from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np

from hora.transport.base import ReduceOp

_INT_KINDS = "iub"  # signed, unsigned, bool

_NUMERIC = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
}

# On booleans, the arithmetic ops have their logical meaning: any/all.
_BOOLEAN = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BOR: np.logical_or,
}


_CHOSEN: dict[tuple, Callable[..., np.ndarray]] = {}


def reduction_ufunc(op: ReduceOp, dtype: np.dtype) -> Callable[..., np.ndarray]:
    """The ufunc that implements ``op`` on ``dtype``; a TypeError for bitwise ops on floats."""
    chosen = _CHOSEN.get((op, dtype))  # every collective asks: remember the answers
    if chosen is None:
        chosen = _CHOSEN[(op, dtype)] = _choose_ufunc(op, dtype)
    return chosen


def _choose_ufunc(op: ReduceOp, dtype: np.dtype) -> Callable[..., np.ndarray]:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return _BOOLEAN[op]
    if op in (ReduceOp.BAND, ReduceOp.BOR) and dtype.kind not in _INT_KINDS:
        raise TypeError(f"bitwise reduction {op} is not defined for dtype {dtype}")
    return _NUMERIC[op]


def check_op(op: ReduceOp, dtype: np.dtype) -> None:
    """Validate an (op, dtype) pair up front, before any byte leaves this rank."""
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a hora.transport.ReduceOp, got {op!r}")
    reduction_ufunc(op, dtype)


_HALF_WIDTH = frozenset((np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)))


def scale_into(src: np.ndarray, factor: float, out: np.ndarray) -> None:
    """``out = src * factor`` element by element (``out`` may be ``src``), as Horovod's CPU ops scale,
    so that a migrated script gets the same bits: float32 and float64 in their own precision (the
    factor rounded to the dtype first); float16 (and bfloat16) through float32, the product rounded
    back once; integers (and bools) in float64, truncated toward zero. Writing the product straight
    into a result buffer lets a transport fold Average's division into its copy out, instead of
    passing over the result once more."""
    if src.size == 0:
        return
    if factor == 1.0:
        if out is not src:
            out[...] = src
        return
    dtype = src.dtype
    if dtype.kind in _INT_KINDS:
        out[...] = (src.astype(np.float64) * factor).astype(dtype)
    elif dtype in _HALF_WIDTH:
        out[...] = np.multiply(src, np.float32(factor), dtype=np.float32)
    else:
        np.multiply(src, dtype.type(factor), out=out)
