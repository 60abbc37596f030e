"""Work arrays kept between collectives, so large ones do not cost fresh memory on every call.

A new NumPy array of many MiB is new anonymous memory: the kernel zeroes every page on first touch
(2 MiB at a time with transparent huge pages), which on the 16-host emulated cluster cost more CPU
than the reduction itself (docs/scaling.md). A communicator runs one collective at a time, so one
array per purpose can be reused; arrays above ``limit`` bytes are not kept (memory is not held for
a rare huge call).
"""

from __future__ import annotations

import numpy as np

KEEP_LIMIT = 64 * 1024 * 1024  # the default fusion buffer: the size the engine's allreduces reach


class ScratchArrays:
    """``get(purpose, count, dtype)``: an uninitialised array, reused while it is big enough."""

    def __init__(self, limit: int = KEEP_LIMIT) -> None:
        self.limit = limit
        self._kept: dict[str, np.ndarray] = {}

    def get(self, purpose: str, count: int, dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = max(1, count) * dtype.itemsize
        if nbytes > self.limit:
            return np.empty(count, dtype=dtype)
        kept = self._kept.get(purpose)
        if kept is None or kept.nbytes < nbytes:
            kept = self._kept[purpose] = np.empty(nbytes, dtype=np.uint8)
        return kept[: count * dtype.itemsize].view(dtype)

    def clear(self) -> None:
        self._kept.clear()
