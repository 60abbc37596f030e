"""The guard every collective of a host transport runs in, and what happens when one fails.

A communicator allows one collective at a time and refuses new ones once it has failed or closed.
When a collective fails, this rank records the failure in the rendezvous store under the
communicator's scope, so the other ranks can name the root cause rather than just their neighbour;
the first record wins, and every rank reports it. Then the communicator's connections are cut
(``cut``), so ranks blocked on this one fail at once instead of waiting out their timeout.

A peer that only went silent (``PeerFailureError.timed_out``) is not necessarily the culprit: every
rank stalled behind a hung one times out at about the same moment and blames its own silent
neighbour. Ranks then publish whom they waited on, and the hung rank is the one blamed that does
not itself report.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, NoReturn

import numpy as np

from hora.errors import PeerFailureError, TransportError
from hora.rendezvous.client import RendezvousClient


class CollectiveGuard:
    """One communicator's failure state; ``guard(what, dtype)`` is the scope of one collective.

    ``members`` are the global ranks of the communicator and ``rank`` this process's index in it.
    ``cut`` shuts the communicator's connections (it must be safe to call more than once), and
    ``flush``, if given, waits up to a timeout for data still being sent when a collective ends.
    """

    __slots__ = ("lock", "closed", "broken", "flush", "timeout", "_store", "_scope", "_members", "_me", "_cut")

    def __init__(
        self,
        store: RendezvousClient,
        scope: str,
        members: list[int],
        rank: int,
        timeout: float,
        cut: Callable[[], None],
        flush: Callable[[float], None] | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.closed = False
        self.broken: PeerFailureError | None = None
        self.flush = flush
        self.timeout = timeout
        self._store = store
        self._scope = scope
        self._members = members
        self._me = members[rank]
        self._cut = cut

    def __call__(self, what: str, reduces: np.dtype | None = None) -> CollectiveScope:
        """The scope of one collective named ``what``.

        ``reduces`` is the dtype the collective computes on, if any: floating-point overflow to inf
        is then the defined result, not a warning (integer reductions never warn, so they skip the
        cost of changing NumPy's error state; this runs on every engine cycle).
        """
        return CollectiveScope(self, what, reduces is not None and reduces.kind not in "iub")

    def check_open(self, what: str) -> None:
        """Raise when the communicator is closed."""
        if self.closed:
            raise TransportError(f"rank {self._me}: {what} on a closed communicator")

    def check_usable(self, what: str) -> None:
        """Raise when the communicator is closed or has already failed."""
        self.check_open(what)
        if self.broken is not None:
            raise PeerFailureError(
                f"rank {self._me}: {what} on a communicator that already failed: {self.broken}",
                self.broken.failed_rank,
            )

    def adopt(self, error: PeerFailureError) -> None:
        """Take over a failure already recorded by a communicator this one is built on."""
        if self.broken is None:
            self.broken = error
        self._cut()

    def failed(self, what: str, exc: BaseException) -> None:
        """Turn an exception that escaped a collective into the recorded, raised failure; other
        exceptions (a local mistake, such as a bad argument) are left to propagate."""
        if isinstance(exc, PeerFailureError):
            reason, failed = str(exc), exc.failed_rank
            if exc.timed_out and failed is not None:
                root = self._hang_root(failed)
                if root != failed:
                    reason = (
                        f"rank {root} made no progress for {self.timeout:.0f} s (it may be hung or stuck "
                        f"outside the collective; ranks downstream of it, such as rank {failed}, waited too)"
                    )
                    failed = root
            self.fail(what, reason, failed)
        elif isinstance(exc, (OSError, TimeoutError)):
            self.fail(what, f"a send failed ({exc})", None)

    def fail(self, what: str, reason: str, failed_rank: int | None) -> NoReturn:
        """Record the failure for the other ranks, cut every connection, raise with the root cause."""
        mine: dict[str, Any] = {"detected_by": self._me, "failed_rank": failed_rank, "reason": reason}
        root = mine
        try:
            won = self._store.set_if_absent(f"{self._scope}/abort", json.dumps(mine).encode())
            root = json.loads(won)
        except Exception:  # the store may be gone with the launcher
            pass
        self._cut()
        if root is mine or root.get("detected_by") == self._me:
            message = f"rank {self._me}: {what} failed: {reason}"
        else:
            message = f"rank {self._me}: {what} failed because rank {root['detected_by']} reported: {root['reason']}"
            failed_rank = root.get("failed_rank")
        self.broken = PeerFailureError(message, failed_rank)
        raise self.broken

    def _hang_root(self, suspect: int) -> int:
        """Which rank is really hung, when this rank timed out waiting on ``suspect``."""
        prefix = f"{self._scope}/stalled/"
        try:
            self._store.set(prefix + str(self._me), str(suspect).encode())
            deadline = time.monotonic() + min(2.0, self.timeout)
            while True:
                reports = {}
                for key in self._store.keys(prefix):
                    value = self._store.try_get(key)
                    if value is not None:
                        reports[int(key.rsplit("/", 1)[1])] = int(value)
                silent = sorted({s for s in reports.values() if s not in reports})
                if len(reports) >= len(self._members) - 1 or time.monotonic() >= deadline:
                    return silent[0] if len(silent) == 1 else suspect
                time.sleep(0.05)
        except Exception:  # the store may be gone with the launcher
            return suspect


class CollectiveScope:
    """``with guard(what):`` as a plain object: a generator-based context manager costs about a
    microsecond more per collective, and small collectives run every engine cycle."""

    __slots__ = ("_guard", "_what", "_quiet", "_errstate")

    def __init__(self, guard: CollectiveGuard, what: str, quiet_fp: bool) -> None:
        self._guard = guard
        self._what = what
        self._quiet = quiet_fp
        self._errstate: Any = None

    def __enter__(self) -> None:
        guard = self._guard
        guard.lock.acquire()
        try:
            if guard.closed or guard.broken is not None:
                guard.check_usable(self._what)  # raises
            if self._quiet:
                self._errstate = np.errstate(over="ignore", invalid="ignore")
                self._errstate.__enter__()
        except BaseException:
            guard.lock.release()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        guard = self._guard
        try:
            if self._errstate is not None:
                self._errstate.__exit__(exc_type, exc, tb)
            if exc is None:
                if guard.flush is not None:
                    try:
                        guard.flush(guard.timeout)
                    except (OSError, TimeoutError) as flush_error:
                        guard.failed(self._what, flush_error)
            else:
                guard.failed(self._what, exc)  # raises for transport failures
            return False
        finally:
            guard.lock.release()
