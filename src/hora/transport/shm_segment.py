"""Shared-memory segments in /dev/shm: one per rank, mapped by every rank of the host.

Each segment is a small control block (int64 counters this rank alone writes), two alternating
slots for small messages, and a data area. Files are created with mode 0600 under random names and
unlinked as soon as every peer has mapped them: once a communicator is formed, nothing is left in
/dev/shm even if every process is killed.
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np

SHM_DIR = "/dev/shm"
CTRL_WORDS = 16  # [0] barrier epoch, [1] abort flag, [2] data offset, rest reserved
SMALL_BYTES = 64 * 1024  # each of the two alternating slots for small messages
ALIGN = 4096
HEADER_BYTES = ALIGN + 2 * SMALL_BYTES


class Segment:
    """A mapped segment: ``ctrl`` (int64 counters) and ``data`` (bytes)."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        self.path = path
        self.capacity = nbytes
        total = HEADER_BYTES + nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, total)  # reserve now: a full tmpfs fails here, not as SIGBUS later
                except OSError:
                    os.close(fd)
                    fd = -1
                    os.unlink(path)
                    raise
            self._map = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            if fd >= 0:
                os.close(fd)
        self.ctrl = np.frombuffer(self._map, dtype=np.int64, count=CTRL_WORDS)
        self.small = [
            np.frombuffer(self._map, dtype=np.uint8, count=SMALL_BYTES, offset=ALIGN + i * SMALL_BYTES)
            for i in (0, 1)
        ]
        self.data = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        self._base = self.data.ctypes.data  # the mapping never moves: look its address up once

    @classmethod
    def create(cls, prefix: str, nbytes: int) -> Segment:
        nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        path = os.path.join(SHM_DIR, f"{prefix}-{secrets.token_hex(8)}")
        return cls(path, nbytes, create=True)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> Segment:
        return cls(path, nbytes, create=False)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def owns(self, array: np.ndarray) -> bool:
        """Whether ``array`` lies inside this segment's data area."""
        base = self._base
        start = array.ctypes.data
        return base <= start and start + array.nbytes <= base + self.capacity

    def offset_of(self, array: np.ndarray) -> int:
        """Byte offset of ``array`` (which :meth:`owns` accepted) from the start of the data area."""
        return array.ctypes.data - self._base

    def close(self) -> None:
        self.ctrl = None  # type: ignore[assignment]  # closed: drop the views; a closed segment is never read
        self.data = None  # type: ignore[assignment]  # as ctrl
        self.small = []
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the last reference
