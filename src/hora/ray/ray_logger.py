"""Values a worker sends to the driver's callbacks while ``RayExecutor.run`` goes on.

horovod.ray's ``ray_logger.log(info_dict)`` under the same name: inside a function that
:meth:`hora.ray.RayExecutor.run` (or ``execute``) runs with ``callbacks=[...]``, ``log`` hands
``info_dict`` to every callback on the driver, soon after it is logged, in the order each worker
logged them. By default only rank 0's values travel (``chief_only``), so a callback sees each
metric once.

The values go through the job's rendezvous store (the driver serves it; every connection proves it
knows the job secret), under keys of the current call, which the driver reads and deletes.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle

from hora.rendezvous import RendezvousClient, RendezvousServer
from hora.workers import identity

logger = logging.getLogger(__name__)

KEY_PREFIX = "ray/log/"

_lock = threading.Lock()
_call: tuple[str, int] | None = None  # (call id, rank) while a call with callbacks runs
_sequence = 0
_client: RendezvousClient | None = None
_warned = False


def call_prefix(call_id: str) -> str:
    """Where one call's logged values live in the store."""
    return f"{KEY_PREFIX}{call_id}/"


def value_key(call_id: str, rank: int, sequence: int) -> str:
    """``<rank>/<pid>/<sequence>``: the process id keeps apart two workers that held one rank in
    turn (an elastic job re-ranks its workers), each counting its own sequence."""
    return f"{call_prefix(call_id)}{rank}/{os.getpid()}/{sequence:09d}"


def log(info_dict: Any, chief_only: bool = True) -> None:
    """Send ``info_dict`` (anything picklable) to the driver's callbacks.

    With ``chief_only`` (the default) only rank 0 sends. Outside a call that has callbacks there is
    nobody to receive it: the value is dropped, with one warning per process.
    """
    global _sequence, _client, _warned
    with _lock:
        if _call is None:
            if not _warned:
                warnings.warn("hora.ray.ray_logger.log was called, but the function does not run under "
                              "RayExecutor.run(..., callbacks=[...]); the value is dropped", stacklevel=2)
                _warned = True
            return
        call_id, rank = _call
        rank = _current_rank(rank)
        if chief_only and rank != 0:
            return
        if _client is None:
            me = identity.from_environment()
            _client = RendezvousClient(me.rendezvous_addr, me.rendezvous_port, me.secret)
        _client.set(value_key(call_id, rank, _sequence), cloudpickle.dumps(info_dict))
        _sequence += 1


def _current_rank(default: int) -> int:
    """hora's rank now where hora is initialised (an elastic job re-ranks its workers), else the rank
    of the last world this worker joined (while the world re-forms), else ``default``."""
    import sys

    basics = sys.modules.get("hora.basics")
    if basics is None:
        return default
    if basics.is_initialized():
        return int(basics.rank())
    last = getattr(basics._ctx, "last_rank", None)
    return default if last is None else int(last)


class active:
    """While a call with callbacks runs on this worker: ``with active(call_id, rank): ...``."""

    def __init__(self, call_id: str | None, rank: int) -> None:
        self._value = None if call_id is None else (call_id, rank)

    def __enter__(self) -> None:
        global _call, _sequence
        with _lock:
            _call, _sequence = self._value, 0

    def __exit__(self, *exc: object) -> None:
        global _call
        with _lock:
            _call = None


def close() -> None:
    """Close this worker's store connection (the job is ending)."""
    global _client
    with _lock:
        client, _client = _client, None
    if client is not None:
        try:
            client.close()
        except OSError as exc:
            logger.debug("closing the logger's store connection: %s", exc)


class CallbackRelay:
    """Hands values workers logged (:mod:`hora.ray.ray_logger`) to the call's callbacks."""

    def __init__(self, server: RendezvousServer | None, call_id: str | None,
                 callbacks: list[Callable[[Any], Any]]) -> None:
        assert server is not None and call_id is not None
        self._store = server.store
        self._prefix = call_prefix(call_id)
        self._callbacks = callbacks
        self._error: BaseException | None = None

    def deliver(self) -> None:
        keys = self._store.keys(self._prefix)
        # Keys are <rank>/<sequence>: each worker's values in the order it logged them.
        for key in sorted(keys, key=lambda k: tuple(int(part) for part in k[len(self._prefix):].split("/"))):
            blob = self._store.try_get(key)
            self._store.delete(key)
            if blob is None or self._error is not None:
                continue
            try:
                value = cloudpickle.loads(blob)
                for callback in self._callbacks:
                    callback(value)
            except Exception as exc:  # reported when the call ends, not mid-run
                logger.warning("hora.ray: a callback raised %r; later values are not delivered", exc)
                self._error = exc

    def finish(self) -> None:
        self.deliver()
        self._store.delete_prefix(self._prefix)

    def raise_failure(self) -> None:
        if self._error is not None:
            raise self._error
