"""Scaling a result by a factor with Horovod's rounding, in one pass from source to destination.

Apart from :mod:`hora.transport.reduce` because the communicator base class uses it and that module
imports the base class; this one imports nothing of hora's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_INT_KINDS = "iub"  # signed, unsigned, bool: scaled through float64, truncated toward zero
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
