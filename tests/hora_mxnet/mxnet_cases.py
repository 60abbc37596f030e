"""The inputs and expected outputs of the MXNet collectives suite, shared by the job (in the MXNet
venv) and the tests (in the main environment): plain NumPy, no MXNet."""

from __future__ import annotations

import numpy as np

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64", "bool"]  # MXNet 1.x NDArray dtypes
OPS = ["Average", "Sum", "Min", "Max", "Product"]
SHAPES = [(4,), (3, 4), (2, 3, 2)]


def ops_for(dtype: str) -> list[str]:
    return ["Sum", "Min", "Max"] if dtype == "bool" else OPS


def value(dtype: str, shape: tuple[int, ...], rank: int) -> np.ndarray:
    """Rank ``rank``'s input: small values (products over 3 ranks stay inside int8)."""
    base = np.arange(int(np.prod(shape))).reshape(shape)
    if dtype == "bool":
        return (base + rank) % 2 == 0
    return (base % 3 + 1 + rank).astype(dtype)


def reduced(dtype: str, shape: tuple[int, ...], op: str, size: int) -> np.ndarray:
    values = [value(dtype, shape, r) for r in range(size)]
    if dtype == "bool":
        stack = np.stack(values)
        return {"Sum": stack.any(0), "Max": stack.any(0), "Min": stack.all(0)}[op]
    wide = np.stack([v.astype(np.float64) for v in values])
    out = {"Sum": wide.sum(0), "Min": wide.min(0), "Max": wide.max(0), "Product": wide.prod(0),
           "Average": wide.sum(0) / size}[op]
    if np.issubdtype(np.dtype(dtype), np.integer):
        out = np.trunc(out)  # integer Average truncates, as in Horovod
    return out.astype(dtype)


def gathered_rows(rank: int) -> int:
    """Rank ``rank``'s first dimension in the allgather checks (they differ between ranks)."""
    return rank + 1
