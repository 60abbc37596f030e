"""The in-memory key-value table behind the rendezvous server.

Kept apart from the network code so the launcher can read and write it directly (it owns the job)
and so blocking semantics (wait for a key, first-writer-wins) are tested without sockets.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable


class KeyValueStore:
    """Thread-safe bytes table with blocking reads."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = bytes(value)
            self._changed.notify_all()

    def set_if_absent(self, key: str, value: bytes) -> bytes:
        """Store ``value`` unless the key exists; return what the key holds afterwards."""
        with self._changed:
            if key not in self._data:
                self._data[key] = bytes(value)
                self._changed.notify_all()
            return self._data[key]

    def add(self, key: str, delta: int) -> int:
        """Atomically add to an integer counter (created at 0) and return the new value."""
        with self._changed:
            value = int(self._data.get(key, b"0")) + int(delta)
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def delete(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def delete_prefix(self, prefix: str) -> int:
        with self._changed:
            doomed = [k for k in self._data if k.startswith(prefix)]
            for k in doomed:
                del self._data[k]
            return len(doomed)

    def keys(self, prefix: str = "") -> list[str]:
        with self._changed:
            return sorted(k for k in self._data if k.startswith(prefix))

    def try_get(self, key: str) -> bytes | None:
        with self._changed:
            return self._data.get(key)

    def wait(self, keys: Iterable[str], timeout: float) -> list[str]:
        """Block until every key exists or ``timeout`` seconds pass; return the keys still missing."""
        wanted = list(keys)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._changed:
            while True:
                missing = [k for k in wanted if k not in self._data]
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    return missing
                self._changed.wait(remaining)

    def get(self, key: str, timeout: float) -> bytes | None:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear; None if it never does."""
        with self._changed:
            deadline = time.monotonic() + max(0.0, timeout)
            while key not in self._data:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)
            return self._data[key]
