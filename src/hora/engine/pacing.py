"""Which thread runs the engine's cycles, and when.

The cycle itself (what one negotiation round does) lives in :mod:`hora.engine.engine`; this module
is the policy around it. A background thread (``hora-engine``) cycles back to back while cycles make
progress and work is pending, else once per cycle time, backing off further while the rank is idle.
A thread that waits on a handle has nothing else to do, so it runs the cycles itself (:meth:`Pacer.drive`)
and the engine thread stands aside: that saves two thread hand-offs per step, which cost more than a
cached cycle on a busy host. Before a cycle, a burst of submissions (a backward pass) is given a
moment to finish arriving, so that it is negotiated and fused as one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from hora.engine import request as request_module
from hora.engine.process_stderr import send_to_process_stderr
from hora.engine.request import Handle
from hora.errors import HorovodInternalError
from hora.transport.timer_slack import fine_timer_slack

logger = logging.getLogger(__name__)
send_to_process_stderr(logger)  # a crashed engine thread must be seen where sys.stderr is captured

#: Submissions closer together than this are one burst (see :meth:`Pacer.settle`).
BURST_GAP_S = 20e-6
#: Idle cycles at the cycle time before the idle wait starts doubling.
IDLE_CYCLES_BEFORE_BACKOFF = 2
#: The longest an idle engine waits between cycles.
MAX_IDLE_WAIT_S = 0.05


class _Settings(Protocol):
    @property
    def cycle_time_s(self) -> float: ...
    @property
    def stall_check(self) -> bool: ...
    @property
    def stall_warning_s(self) -> float: ...


class Cycles(Protocol):
    """What the pacer asks of the engine whose cycles it runs (:class:`hora.engine.engine.Engine`)."""

    global_rank: int

    @property
    def settings(self) -> _Settings:
        """The engine's knobs; ``cycle_time_s`` may change while the job runs (autotune)."""
        ...

    #: cycles stopped for good (shut down or failed)
    stopped: bool
    #: this rank asked to shut down: cycle at once to tell the others
    stop_requested: bool
    #: the last cycle executed something
    progress: bool
    #: cycles in a row that found nothing to do
    idle_cycles: int
    #: ``time.perf_counter()`` of the last submission
    last_submit: float

    def iterate(self) -> None: ...
    def has_work(self) -> bool: ...
    def inbox_pending(self) -> bool: ...
    def stop(self, error: HorovodInternalError) -> None: ...
    def report_wait(self, handle: Handle, waited: float) -> None: ...
    def abandon_if_stopped(self, handle: Handle) -> bool: ...


class Pacer:
    """Runs ``cycles``' cycles on a thread of its own, or on a thread that waits on a handle."""

    def __init__(self, cycles: Cycles) -> None:
        self._cycles = cycles
        #: Set to wake the engine thread early (a submission during a long wait, a driver leaving, stop).
        self.wake = threading.Event()
        #: Held while a cycle runs, by the engine thread or by a thread waiting on a handle (drive).
        self.cycle_lock = threading.Lock()
        self._drivers = 0  # threads now driving cycles from Handle.wait
        self._drivers_lock = threading.Lock()
        self._long_wait = True  # the engine thread waits longer than a cycle time: wake it on submit
        self.thread = threading.Thread(target=self._loop, name="hora-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submitted(self) -> None:
        """A submission was queued. The engine thread polls its inbox every cycle time; it is woken
        only from a longer idle wait. Waking it on every submission would cost more than the cycle it
        saves: it would contend for the GIL with the submitting thread, which usually goes on to wait
        and run the cycle itself (drive). Requests are queued before this check and the engine
        clears the event before draining, so a set event means a drain is still to come that will
        see them."""
        if self._long_wait and not self.wake.is_set():
            self.wake.set()

    # ---- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        cycles = self._cycles
        try:
            self._run_cycles()
        except BaseException as exc:  # a bug here must fail the pending handles, not strand them
            if not cycles.stopped:
                logger.error("rank %d: engine thread crashed: %r", cycles.global_rank, exc)
                cycles.stop(HorovodInternalError(f"rank {cycles.global_rank}: engine thread crashed: {exc!r}"))
            if not isinstance(exc, Exception):
                raise

    def _run_cycles(self) -> None:
        cycles = self._cycles
        fine_timer_slack()  # the settle wait and idle waits are short sleeps
        while not cycles.stopped:
            # Idle ranks still cycle every cycle_time (peers may be waiting on them); with work,
            # cycles run back to back, each first letting a burst of submissions settle.
            # Cycle again at once only after progress with work still pending (or when new
            # requests are queued); otherwise wait for a submission, or the cycle time (longer
            # when idle a while). A rank whose work is all done has nothing to tell its peers
            # that cannot wait for its next submission or cycle time.
            if self.should_cycle_now() or self._wait(self.idle_wait()) or cycles.inbox_pending():
                if self._drivers:
                    # A waiting thread is running the cycles; it wakes us when it leaves. Clear,
                    # then look again: a driver that left before the clear is seen leaving here,
                    # one that leaves after it sets the event this wait returns on.
                    self.wake.clear()
                    if self._drivers:
                        self._wait(self.idle_wait())
                    continue
                self.settle()
            with self.cycle_lock:
                if cycles.stopped:
                    return
                if self._drivers:
                    continue  # a driver arrived meanwhile: the branch above waits for it
                if self.wake.is_set():
                    self.wake.clear()
                cycles.iterate()

    def _wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a wake-up; True if woken (or work is already queued).

        A submission wakes a long wait: it queues its requests, then reads ``_long_wait``; this
        sets ``_long_wait``, then looks at the queues. Whichever runs second sees the other's
        write, so a submission is never left waiting out a long wait.
        """
        long_wait = timeout > self._cycles.settings.cycle_time_s
        self._long_wait = long_wait
        try:
            if long_wait and not self._drivers and self._cycles.inbox_pending():
                return True  # (with a driver, the driver runs the cycle that drains them)
            return self.wake.wait(timeout)
        finally:
            self._long_wait = False

    # ---- a thread waiting on a handle ----------------------------------------------------------

    def drive(self, handle: Handle) -> None:
        """Run cycles in a thread that waits on ``handle`` until it completes. Cycles follow the
        engine thread's pacing: back to back while they make progress, else one per cycle time."""
        if threading.current_thread() is self.thread:
            return
        cycles = self._cycles
        fine_timer_slack()
        counted = False
        try:
            with self._drivers_lock:
                self._drivers += 1
                counted = True
            request_module.mark_waiting()  # after counting: the engine thread, seeing it, yields to us
            first = True
            since = time.monotonic()
            settings = cycles.settings
            report_after = settings.stall_warning_s if settings.stall_check else 0.0
            next_report = report_after
            while not handle._finished and not cycles.stopped:
                if not first and not self.should_cycle_now():
                    if handle.wait_done(self.idle_wait()):
                        return
                    if report_after > 0:  # nothing to do but wait: say so now and then
                        waited = time.monotonic() - since
                        if waited >= next_report:
                            cycles.report_wait(handle, waited)
                            next_report = waited + report_after
                first = False
                if not self.cycle_lock.acquire(timeout=settings.cycle_time_s):
                    continue  # the engine thread is mid-cycle; it may finish this handle
                try:
                    if handle._finished or cycles.stopped:
                        return
                    if self.wake.is_set():
                        self.wake.clear()
                    cycles.iterate()
                finally:
                    self.cycle_lock.release()
        finally:
            if counted:
                with self._drivers_lock:
                    self._drivers -= 1
                    last = self._drivers == 0
                if last and cycles.has_work():
                    self.wake.set()  # hand what is left to the engine thread
            cycles.abandon_if_stopped(handle)  # a stopped engine completes nothing more

    # ---- when to cycle -------------------------------------------------------------------------

    def should_cycle_now(self) -> bool:
        cycles = self._cycles
        return (cycles.progress and cycles.has_work()) or cycles.stop_requested or cycles.inbox_pending()

    def idle_wait(self) -> float:
        """Seconds an idle engine waits before its next cycle.

        Every idle cycle is a collective, so it costs CPU that training needs (a forward pass is all
        idle cycles, and so are the gaps between a backward pass's buckets). After a couple of idle
        cycles the wait doubles each cycle, up to ``MAX_IDLE_WAIT_S``. Nothing waits on an idle rank's
        cycles but peers that already hold a collective this rank has not submitted yet: its own
        submission wakes it at once, so the backoff delays no training step, only a peer's view of
        this rank's shutdown or negotiation flags (by at most ``MAX_IDLE_WAIT_S``).
        """
        cycles = self._cycles
        base = cycles.settings.cycle_time_s
        if cycles.has_work():  # waiting on peers: keep the cycle time
            return base
        extra = cycles.idle_cycles - IDLE_CYCLES_BEFORE_BACKOFF
        return base if extra < 0 else min(MAX_IDLE_WAIT_S, base * (2 << min(extra, 16)))

    def settle(self) -> None:
        """Let a burst of submissions (a backward pass, a grouped step) finish arriving, so that it is
        negotiated and fused as one instead of trickling over several cycles.

        A burst is submissions closer together than ``BURST_GAP_S``, and it is over as soon as a
        thread blocks on a handle after the last submission (the usual end of a burst: submit, then
        synchronize). Waiting yields the GIL to the submitting thread, never longer than one cycle.
        """
        cycles = self._cycles
        deadline = time.perf_counter() + cycles.settings.cycle_time_s
        while True:
            now = time.perf_counter()
            last = cycles.last_submit
            if now - last >= BURST_GAP_S or now >= deadline or request_module.last_wait_started > last:
                return
            time.sleep(0)
