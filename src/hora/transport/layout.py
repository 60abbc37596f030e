"""How a flat buffer is cut among ranks: the index arithmetic every transport shares.

Ranks must agree on every boundary without talking, so these are pure functions of their
arguments; any rank that calls them with the same numbers gets the same cuts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def split_offsets(count: int, parts: int) -> list[int]:
    """Element offsets cutting ``count`` into ``parts`` near-equal segments (``parts + 1`` entries);
    the first ``count % parts`` segments hold one element more."""
    base, extra = divmod(count, parts)
    offsets = [0]
    for i in range(parts):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets


def count_offsets(counts: Sequence[int]) -> list[int]:
    """Start of each rank's block when blocks of ``counts`` elements lie back to back, plus the end."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def bytes_of(arr: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (bfloat16 included), for socket and copy calls."""
    return arr.reshape(-1).view(np.uint8).data
