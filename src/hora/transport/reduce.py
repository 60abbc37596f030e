"""Element-wise reduction kernels shared by every host-memory transport.

Each kernel combines ``src`` into ``dst`` in place with one NumPy ufunc call, so the GIL is released
for the bulk of the work and a transport's network threads keep running while a chunk is reduced.
"""

from __future__ import annotations

from collections.abc import Callable

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


_CHOSEN: dict[tuple[object, ...], Callable[..., np.ndarray]] = {}


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

