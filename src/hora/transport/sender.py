"""A background thread that writes queued buffers to sockets, in order.

Collectives are pipelined: while the caller's thread receives and reduces chunk k, this thread is
still sending chunk k-1. Separating the two also makes simultaneous large sends between two ranks
deadlock-free: neither side's receive waits for its own send to finish.
"""

from __future__ import annotations

import queue
import socket
import threading


class _Fence:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class AsyncSender:
    """Sends ``(socket, memoryview)`` items in FIFO order on one thread."""

    def __init__(self, name: str = "hora-sender") -> None:
        self._queue: queue.SimpleQueue[tuple[socket.socket, memoryview] | _Fence | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._queued = False  # anything sent since the last flush? (a fence costs a thread handoff)
        #: Bytes queued for sending since the start (what the transport counts as sent).
        self.bytes_queued = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def send(self, sock: socket.socket, view: memoryview) -> None:
        """Queue ``view`` for sending; it must stay untouched until :meth:`flush` returns."""
        if len(view):
            self._queued = True
            self.bytes_queued += view.nbytes
            self._queue.put((sock, view))

    def flush(self, timeout: float) -> None:
        """Wait until everything queued so far is sent; raise the send error, if any."""
        if not self._queued:
            if self.error is not None:
                raise self.error
            return
        self._queued = False
        fence = _Fence()
        self._queue.put(fence)
        if not fence.done.wait(timeout):
            raise TimeoutError(f"sending did not finish within {timeout:.0f} s")
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Fence):
                item.done.set()
                continue
            if self.error is not None:
                continue  # drain: the collective has already failed
            sock, view = item
            try:
                sock.sendall(view)
            except BaseException as exc:  # handed to the caller's thread
                self.error = exc
