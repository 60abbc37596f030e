"""Noticing worker exits with one thread, whatever the number of workers.

A thread per worker blocked in ``wait`` costs a 64-rank launcher 64 threads. Instead, one thread
holds a Linux pidfd per worker process in a selector: the kernel makes it readable when the process
exits, so an exit is seen at once and nothing is polled while workers run. A worker whose exit needs
a little more before it can be reported (a remote rank's status line still on its way through
stderr) is asked again every few tens of milliseconds, within its own bound. Where pidfds are not
available (an old kernel, not Linux) every worker is polled on that period instead. Workers that
offer only a blocking ``wait`` (a Ray actor) get a thread of their own, as before.
"""

from __future__ import annotations

import logging
import os
import select
import selectors
import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

# How often a worker without a pidfd, or one that exited but is not ready to report, is asked again.
POLL_SECONDS = 0.05

_K = TypeVar("_K", bound=Hashable)  # what names a worker (its rank)


def _pidfd(pid: int | None) -> int | None:
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # ENOSYS on an old kernel; ESRCH cannot happen for an unreaped child
        return None


class ExitWatcher(Generic[_K]):
    """Calls ``on_exit(key, returncode, detail)`` once for each watched worker, from one thread.

    A watched worker has ``poll_exit() -> (returncode, detail) | None`` and, for the pidfd, ``pid`` (a
    child of this process); one with only ``wait()`` is waited on in a thread of its own. The thread
    starts with the first worker and ends when none is left; :meth:`close` stops it early.
    """

    def __init__(self, on_exit: Callable[[_K, int, str | None], None], name: str = "hora-exits") -> None:
        self._on_exit = on_exit
        self._name = name
        self._lock = threading.Lock()
        self._new: list[tuple[_K, Any]] = []
        self._watched = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake_w: int | None = None

    def watch(self, key: _K, worker: Any) -> None:
        """Report ``worker``'s exit under ``key``."""
        if not callable(getattr(worker, "poll_exit", None)):
            threading.Thread(target=self._wait_blocking, args=(key, worker),
                             name=f"{self._name}-{key}", daemon=True).start()
            return
        with self._lock:
            self._new.append((key, worker))
            self._watched += 1
            if self._thread is None:
                wake_r, self._wake_w = os.pipe()
                self._closed = False
                self._thread = threading.Thread(target=self._loop, args=(wake_r,), name=self._name,
                                                daemon=True)
                self._thread.start()
            else:
                self._wake()

    def close(self) -> None:
        """Stop watching (workers not yet reported are not reported)."""
        with self._lock:
            self._closed = True
            if self._thread is not None:
                self._wake()

    def _wake(self) -> None:
        wake_w = self._wake_w
        assert wake_w is not None, "called only while the loop runs"
        try:
            os.write(wake_w, b"x")
        except OSError:
            pass  # a full wake pipe already wakes the loop

    def _wait_blocking(self, key: _K, worker: Any) -> None:
        returncode, detail = worker.wait()
        self._report(key, returncode, detail)

    def _report(self, key: _K, returncode: int, detail: str | None) -> None:
        try:
            self._on_exit(key, returncode, detail)
        except Exception:  # one bad callback must not blind the watcher to the rest
            logger.exception("reporting the exit of worker %s failed", key)

    def _loop(self, wake_r: int) -> None:
        os.set_blocking(wake_r, False)
        selector = selectors.DefaultSelector()
        selector.register(wake_r, selectors.EVENT_READ, None)
        polled: dict[_K, Any] = {}  # asked every POLL_SECONDS: no pidfd, or exited but not ready
        pidfds: dict[_K, int] = {}
        try:
            while True:
                with self._lock:
                    if self._closed or self._watched == 0:
                        if self._wake_w is not None:  # set while this loop runs
                            os.close(self._wake_w)
                        self._thread = self._wake_w = None
                        return
                    new, self._new = self._new, []
                ready: dict[_K, Any] = {}  # keyed: a worker is asked once per pass
                for key, worker in new:
                    fd = _pidfd(getattr(worker, "pid", None))
                    if fd is None:
                        polled[key] = worker
                    else:
                        pidfds[key] = fd
                        selector.register(fd, selectors.EVENT_READ, (key, worker))
                        ready[key] = worker  # it may have exited already
                for selected, _events in selector.select(POLL_SECONDS if polled else None):
                    if selected.data is None:
                        try:
                            while os.read(wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                    else:
                        key, worker = selected.data
                        ready[key] = worker
                ready.update(polled)
                for key, worker in ready.items():
                    result = worker.poll_exit()
                    if result is None:
                        fd = pidfds.get(key)
                        if fd is not None and _readable(fd):
                            # Exited but not ready to report: poll it instead of spinning on its pidfd.
                            self._forget(selector, pidfds, key)
                            polled[key] = worker
                        continue
                    polled.pop(key, None)
                    self._forget(selector, pidfds, key)
                    with self._lock:
                        self._watched -= 1
                    self._report(key, *result)
        finally:
            for fd in pidfds.values():
                selector.unregister(fd)
                os.close(fd)
            selector.close()
            os.close(wake_r)

    @staticmethod
    def _forget(selector: selectors.BaseSelector, pidfds: dict[_K, int], key: _K) -> None:
        fd = pidfds.pop(key, None)
        if fd is not None:
            selector.unregister(fd)
            os.close(fd)


def _readable(fd: int) -> bool:
    """Whether ``fd`` is readable right now (for a pidfd: whether its process has exited)."""
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)
