"""A plain NumPy reference of Adasum, written from the paper's formula, independent of hora's code.

Two vectors combine as (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b, dot products in float64, the
combination computed in float32 for float16 and in float64 otherwise, rounded once to the dtype.
The ranks combine in the tree hora documents: for a world of size n with p the largest power of two
<= n, rank p + i is first folded into rank i (rank i on the left); then pairs at distance 1, 2, 4, ...
(the lower rank's running result on the left).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot, aa, bb = a64 @ b64, a64 @ a64, b64 @ b64
    ca = 1.0 - dot / (2 * aa) if aa >= 1e-8 else 1.0
    cb = 1.0 - dot / (2 * bb) if bb >= 1e-8 else 1.0
    work = np.float32 if a.dtype == np.float16 or a.dtype.name == "bfloat16" else np.float64
    return (a.astype(work) * work(ca) + b.astype(work) * work(cb)).astype(a.dtype)


def tree(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Adasum of one tensor's per-rank values, in hora's pairing order."""
    values = list(vectors)
    n = len(values)
    p = 1 << (n.bit_length() - 1)
    for i in range(n - p):
        values[i] = pair(values[i], values[p + i])
    distance = 1
    while distance < p:
        for r in range(0, p, 2 * distance):
            values[r] = pair(values[r], values[r + distance])
        distance *= 2
    return values[0]


def hierarchical(vectors: Sequence[np.ndarray], hosts: Sequence[Sequence[int]]) -> np.ndarray:
    """Each host's ranks averaged (summed, then divided by the host's rank count), then Adasum across hosts."""
    averages = []
    for host in hosts:
        total = vectors[host[0]].astype(np.float64 if vectors[0].dtype == np.float64 else np.float32)
        for r in host[1:]:
            total = total + vectors[r]
        averages.append((total / len(host)).astype(vectors[0].dtype))
    return tree(averages)


def rank_input(rank: int, shape: tuple[int, ...], dtype, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: a part shared by every rank plus a part of its own, so that the ranks'
    vectors are neither parallel nor orthogonal (every coefficient is exercised)."""
    shared = np.random.default_rng(seed).standard_normal(shape)
    own = np.random.default_rng(1000 + 17 * rank + seed).standard_normal(shape)
    return (0.6 * shared + (0.5 + 0.25 * rank) * own).astype(dtype)
