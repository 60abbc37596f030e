"""Precise short sleeps for threads that poll.

Linux rounds a thread's sleeps up by its *timer slack* (50 us by default), so ``time.sleep(0)``,
which polling loops use to yield the GIL and the CPU, costs the slack on top of the sleep itself. A
shared-memory collective polls its peers' counters; with the default slack every wait that outlasts
the spin phase costs a full slack period, more than the collective itself. Threads that poll
lower their own slack once (the setting is per thread and inherited by threads they start).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

logger = logging.getLogger(__name__)

_PR_SET_TIMERSLACK = 29
_SLACK_NS = 1000  # 1 us: short sleeps become short, without turning the timer into a busy loop
_local = threading.local()
_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        _prctl = None


def fine_timer_slack() -> None:
    """Lower the calling thread's timer slack (once per thread; a no-op off Linux)."""
    if getattr(_local, "done", False):
        return
    _local.done = True
    if _prctl is None:
        return
    if _prctl(_PR_SET_TIMERSLACK, _SLACK_NS, 0, 0, 0) != 0:  # pragma: no cover - refused by the kernel
        logger.debug("prctl(PR_SET_TIMERSLACK) failed (errno %d)", ctypes.get_errno())
