"""The engine's negotiation cycle, run by its background thread or by a thread waiting on a handle.

Each cycle, for every process set this rank belongs to (in id order, so all ranks agree):
1. drain newly submitted requests; a request that matches a cached response sets that entry's bit;
2. one bitwise-AND allreduce of a small control vector tells every member which cached tensors are
   ready everywhere, whether anyone has uncached requests, invalidated entries or wants to shut down;
3. cached-and-ready tensors execute at once; if anyone has uncached requests, their signatures go to
   the coordinator, which answers with the ordered responses every member then executes.
The framework thread only ever blocks in ``Handle.wait``, where it runs cycles itself (``drive``).
Every wait ends: in the result, in an error (a stopped engine fails whatever it did not complete,
a removed process set fails what was pending on it), or, while it goes on, in a stall report.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import numpy as np

from hora.engine.autotune import AutotuneConfig, Autotuner, TuningParams
from hora.engine.cache import Lookup, ResponseCache
from hora.engine.coordinator import Coordinator
from hora.engine.executor import Executor, Item
from hora.engine.pacing import Pacer
from hora.engine.process_stderr import send_to_process_stderr
from hora.engine.request import PROCESS_SET_KINDS, Handle, Kind, Request, process_set_signature
from hora.engine.timeline import Timeline
from hora.errors import HorovodInternalError
from hora.transport.base import Communicator, ReduceOp

# Enum members looked up once (attribute access on an Enum class is slow; these run per tensor or cycle).
_BAND = ReduceOp.BAND

logger = logging.getLogger(__name__)
# Stall reports and the other warnings of the engine must be seen even where sys.stderr is captured.
send_to_process_stderr(logger)

_FLAG_UNCACHED = 1
_FLAG_SHUTDOWN = 2
#: This rank's NCCL work failed or stalled: every member stops in the same cycle (rather than wait
#: out the transport timeout on a rank whose engine stopped).
_FLAG_DEVICE_FAILED = 4
#: Bits from _ARRIVAL_SHIFT up of the OR-ed flags word say which members readied cached tensors since
#: the last cycle: the timeline names the late arrivals of cache-served negotiations from them (for
#: the first 56 members of a set; name-negotiated rounds name every rank).
_ARRIVAL_SHIFT = 8
_ARRIVAL_MEMBERS = 64 - _ARRIVAL_SHIFT
_WORD = (1 << 64) - 1
_NEVER_CACHED = frozenset((Kind.JOIN, Kind.BARRIER)) | PROCESS_SET_KINDS


def _exchange_control(comm: Communicator, words: int, flags: int, invalid: int, ready: int,
                      small: np.ndarray) -> tuple[int, int, int]:
    """The cycle's one collective: a bitwise AND over every member of
    ``[~flags | ~invalid bits | ready bits]``, so flags and invalid bits come back OR-ed (anyone set
    them) and ready bits AND-ed (everyone set them). Bits are Python ints, ``words`` 64-bit words each.
    ``small`` is the process set's own three-word uint64 vector, reused every cycle (cycles of one
    set never overlap) when the bits fit one word each.
    """
    if comm.size == 1:
        return flags, invalid, ready
    if words <= 1:  # up to 64 cached tensors: three words, no byte juggling
        small[0] = ~flags & _WORD
        small[1] = ~invalid & _WORD
        small[2] = ready
        comm.allreduce(small.view(np.int64), _BAND)  # transports move signed words
        flags_word, invalid_word, ready_word = small.tolist()
        return ~flags_word & _WORD, ~invalid_word & _WORD, ready_word
    full = (1 << (64 * words)) - 1
    nbytes = 8 * words
    vec = np.frombuffer(
        bytearray((~flags & _WORD).to_bytes(8, "little")
                  + (~invalid & full).to_bytes(nbytes, "little")
                  + ready.to_bytes(nbytes, "little")),
        dtype=np.int64,
    )
    comm.allreduce(vec, _BAND)
    raw = vec.tobytes()
    return (
        ~int.from_bytes(raw[:8], "little") & _WORD,
        ~int.from_bytes(raw[8 : 8 + nbytes], "little") & full,
        int.from_bytes(raw[8 + nbytes :], "little"),
    )


@dataclass
class EngineSettings:
    fusion_threshold: int
    cycle_time_s: float
    cache_capacity: int
    stall_check: bool
    stall_warning_s: float
    stall_shutdown_s: float



class _SwitchableHierarchy(Protocol):
    """A communicator whose ``can_switch_hierarchy`` is true (a hierarchical one)."""

    use_hierarchy: bool


class DeviceContextLike(Protocol):
    """The engine's view of :class:`hora.nccl.context.DeviceContext` (the engine imports no NCCL)."""

    def runner(self, set_id: int, members: list[int]) -> Any: ...
    def release(self, set_id: int) -> None: ...
    def close(self, failed: bool = False) -> None: ...
    def abort(self, reason: str, announce: Callable[[str], None] | None = None) -> str: ...

@dataclass
class SetState:
    """Negotiation state of one process set on this rank."""

    set_id: int
    members: list[int]
    comm: Communicator
    cache: ResponseCache
    executor: Executor
    coordinator: Coordinator | None
    inbox: queue.SimpleQueue[Request] = field(default_factory=queue.SimpleQueue)
    in_flight: dict[str, Request] = field(default_factory=dict)  # submitted, not yet completed
    by_bit: dict[int, Request] = field(default_factory=dict)
    invalid: set[int] = field(default_factory=set)
    uncached: list[Request] = field(default_factory=list)
    awaiting: dict[str, Request] = field(default_factory=dict)  # sent to the coordinator
    joined: tuple[int, ...] = ()
    last_round: float = 0.0
    control: np.ndarray = field(default_factory=lambda: np.zeros(3, np.uint64))  # see _exchange_control
    arrived: bool = False  # this member readied cached tensors since the last control exchange


class Engine:
    """Owns the background thread, the process sets and every in-flight request of this rank."""

    def __init__(
        self,
        world: Communicator,
        settings: EngineSettings,
        make_communicator: Callable[[int, list[int], str], Communicator],
        timeline: Timeline | None = None,
        device_context: DeviceContextLike | None = None,
    ) -> None:
        self.settings = settings
        #: The world's NCCL side (hora.nccl.context.DeviceContext); untouched until a CUDA tensor is
        #: negotiated for the device path. None: CUDA tensors always go through host memory.
        self.device_context = device_context
        self.world = world
        self.global_rank = world.rank  # ranks as hora.rank() numbers them
        self._make_communicator = make_communicator
        self.timeline = timeline if self.global_rank == 0 else None
        self._lock = threading.Lock()
        self.stopped = False  # no more cycles: shut down or failed
        self._failed = False  # stopped by a failure, not by an agreed shutdown
        self.stop_requested = False
        self._failure: HorovodInternalError | None = None
        self._device_failure: HorovodInternalError | None = None  # told to peers by _FLAG_DEVICE_FAILED
        self.last_submit = 0.0
        self.idle_cycles = 0
        self.progress = False
        self._sets: dict[int, SetState] = {}
        # The same states in id order, replaced (never mutated) when a set is added or removed, so
        # that a thread outside the cycle may look at them while a cycle changes the sets.
        self._states: tuple[SetState, ...] = ()
        self._known_sets: dict[int, list[int]] = {}
        self._next_set_id = 1
        # Unnamed collectives: a counter per process set and kind, started over when a join completes
        # (see auto_name).
        self._name_counters: dict[tuple[int, str], itertools.count[int]] = {}
        self._join_epoch = 0
        #: Negotiation rounds (name-based coordinator exchanges) this rank has taken part in, all
        #: process sets together. Steady state served by the response cache adds none.
        self.negotiation_rounds = 0
        #: What the communicators of removed process sets had sent, so bytes_sent() never goes back.
        self._removed_bytes_sent: list[int | None] = []
        #: Set by enable_autotune(): tunes the knobs below while the job trains.
        self.autotuner: Autotuner | None = None
        self._add_set(0, list(range(world.size)), world)
        self._pacer = Pacer(self)
        self._pacer.start()

    def bytes_sent(self) -> int | None:
        """Bytes every communicator of this rank (the world's and each process set's, removed ones
        included) has sent to peers; None when one of them cannot count (see Communicator.bytes_sent)."""
        counts = [state.comm.bytes_sent for state in self._states] + self._removed_bytes_sent
        return None if None in counts else sum(c for c in counts if c is not None)

    # ---- process sets -------------------------------------------------------------------------

    def _add_set(self, set_id: int, members: list[int], comm: Communicator | None) -> None:
        self._known_sets[set_id] = list(members)
        if comm is None:
            return
        state = SetState(
            set_id=set_id,
            members=list(members),
            comm=comm,
            cache=ResponseCache(self.settings.cache_capacity),
            executor=Executor(comm, list(members), self.settings.fusion_threshold, self.timeline),
            coordinator=Coordinator(list(members)) if comm.rank == 0 else None,
        )
        state.executor.before_complete = functools.partial(self._finished, state)
        if self.device_context is not None:
            context = self.device_context
            state.executor.device_runner_factory = lambda: context.runner(set_id, list(members))
        self._sets[set_id] = state
        self._states = tuple(self._sets[k] for k in sorted(self._sets))

    def enable_autotune(self, config: AutotuneConfig) -> Autotuner:
        """Start tuning (called on every rank right after the engine starts, before any collective)."""
        world_state = self._sets[0]
        switchable = getattr(world_state.comm, "can_switch_hierarchy", False)
        initial = TuningParams(
            fusion_threshold_mb=self.settings.fusion_threshold / (1024 * 1024),
            cycle_time_ms=self.settings.cycle_time_s * 1000.0,
            cache_enabled=self.settings.cache_capacity > 0,
            hierarchical_allreduce=bool(getattr(world_state.comm, "use_hierarchy", False)))
        if not switchable:
            config = replace(config, fixed_hierarchical=True)
        if self.settings.cache_capacity <= 0:
            config = replace(config, fixed_cache=True)  # a cache of no entries has nothing to turn on
        with self._pacer.cycle_lock:
            self.autotuner = Autotuner(config, initial, is_coordinator=world_state.comm.rank == 0,
                                       apply=self._apply_tuning,
                                       broadcast=lambda obj: world_state.comm.broadcast_object(obj, 0))
        return self.autotuner

    def _apply_tuning(self, params: TuningParams) -> None:
        """Set the engine's knobs (at the same cycle on every rank: see Autotuner.end_sample)."""
        threshold = int(round(params.fusion_threshold_mb * 1024 * 1024))
        self.settings.fusion_threshold = threshold
        self.settings.cycle_time_s = params.cycle_time_ms / 1000.0
        for state in self._states:
            state.executor.threshold = threshold
            if state.cache.suspended == params.cache_enabled:
                state.cache.suspend(not params.cache_enabled)
                if state.cache.suspended:
                    # Requests announced by cache bit go by name from now on, on every rank alike.
                    state.uncached.extend(state.by_bit.values())
                    state.by_bit.clear()
                    state.invalid.clear()
            if getattr(state.comm, "can_switch_hierarchy", False):
                cast(_SwitchableHierarchy, state.comm).use_hierarchy = params.hierarchical_allreduce

    def set_timeline(self, timeline: Timeline | None) -> Timeline | None:
        """Swap the timeline (start_timeline/stop_timeline); returns the previous one."""
        with self._lock:
            previous = self.timeline
            self.timeline = timeline if self.global_rank == 0 else None
            for state in self._sets.values():
                state.executor.timeline = self.timeline
            return previous

    # ---- submission ---------------------------------------------------------------------------

    def auto_name(self, kind: str, process_set_id: int = 0) -> str:
        """A name for an unnamed collective, the same on every rank that makes the same calls.

        Ranks need not make the same calls: a process set's collectives are made by its members
        only, and while some ranks have joined, the others call collectives the joined ones never
        do. So names are counted per process set and per kind (a set's names are only ever matched
        among its members), and every counter starts over, in a new epoch so that no name repeats
        one still in flight, when a join completes: the point at which every rank is back in step.
        """
        key = (process_set_id, kind.lower())  # "ALLREDUCE" and "allreduce" share names, and a counter
        counter = self._name_counters.get(key)
        if counter is None:
            counter = self._name_counters.setdefault(key, itertools.count())
        if process_set_id:
            return f"{key[1]}.noname.set{process_set_id}.{self._join_epoch}.{next(counter)}"
        return f"{key[1]}.noname.{self._join_epoch}.{next(counter)}"

    def submit(self, requests: list[Request]) -> list[Handle]:
        """Queue requests (a grouped collective's members together); returns their handles at once."""
        with self._lock:
            if self._failure is not None:
                raise HorovodInternalError(str(self._failure))
            if self.stop_requested:
                raise HorovodInternalError("hora is shutting down; no new collectives are accepted")
            set_id = requests[0].process_set_id
            state = self._sets.get(set_id)
            if state is None:
                if set_id in self._known_sets:
                    raise ValueError(
                        f"rank {self.global_rank} is not in process set {set_id} "
                        f"(ranks {self._known_sets[set_id]})"
                    )
                raise ValueError(f"process set {set_id} does not exist (was it removed?)")
            in_flight = state.in_flight
            if len(requests) == 1:
                if requests[0].name in in_flight:
                    self._raise_in_flight(requests[0].name)
            else:
                seen: set[str] = set()
                for request in requests:
                    if request.name in in_flight or request.name in seen:
                        self._raise_in_flight(request.name)
                    seen.add(request.name)
            now = time.monotonic()
            self.last_submit = time.perf_counter()
            inbox = state.inbox
            for request in requests:
                request.submitted_at = now
                request.handle.driver = self
                in_flight[request.name] = request
                inbox.put(request)
        self._pacer.submitted()
        return [r.handle for r in requests]

    def add_process_set(self, ranks: list[int], name: str) -> Handle:
        """Start adding a process set of these global ranks (every rank of the job calls it, in the
        same order); the handle's result is the new set's id."""
        return self.submit([Request(name, process_set_signature(ranks=tuple(ranks)), None, Handle(name))])[0]

    def remove_process_set(self, set_id: int, name: str) -> Handle:
        """Start removing process set ``set_id`` (every rank calls it); the result says whether it
        existed. Collectives still pending on it fail."""
        return self.submit([Request(name, process_set_signature(set_id=set_id), None, Handle(name))])[0]

    def _raise_in_flight(self, name: str) -> None:
        raise ValueError(
            f"a collective named {name!r} is still in flight on rank {self.global_rank}; "
            "wait for it (synchronize) or use another name"
        )

    # ---- lifecycle ----------------------------------------------------------------------------

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after telling every rank (through the next cycle); fails whatever is still pending."""
        with self._lock:
            self.stop_requested = True
        self._pacer.wake.set()
        self._pacer.thread.join(timeout)
        if self._pacer.thread.is_alive():
            logger.warning("rank %d: engine thread did not stop within %.0f s", self.global_rank, timeout)
            self.stop(HorovodInternalError(
                f"rank {self.global_rank}: hora was shut down while this collective was pending"))
        for set_id, state in self._sets.items():
            if set_id != 0:
                state.comm.close()
        if self.device_context is not None:
            try:
                self.device_context.close(failed=self._failed)
            except Exception as exc:  # shutdown goes on; what failed is logged
                logger.warning("rank %d: closing the NCCL communicators failed: %s", self.global_rank, exc)

    def _fail_all(self, error: HorovodInternalError) -> None:
        """Fail every pending request of every process set (each queued request is also in its
        set's ``in_flight``, see submit); later submissions raise ``error``."""
        with self._lock:
            if self._failure is None:
                self._failure = error
            for state in self._sets.values():
                self._fail_requests(list(state.in_flight.values()), str(error))
                state.in_flight.clear()

    @staticmethod
    def _fail_requests(requests: list[Request], message: str) -> None:
        # Under self._lock: the one place, besides a cycle, that completes handles.
        for request in requests:
            if not request.handle.done():
                request.handle.set_error(HorovodInternalError(message))

    def abandon_if_stopped(self, handle: Handle) -> bool:
        """Fail ``handle`` if this engine has stopped without completing it; True if it did.

        A waiting thread calls this between bounded waits, so that a handle the engine can no
        longer complete (it stopped, or failed, while the handle waited) ends in an error instead
        of a wait that nothing will ever end.
        """
        if not self.stopped or handle.done():
            return False
        with self._lock:
            if not handle.done():
                failure = self._failure
                handle.set_error(HorovodInternalError(
                    str(failure) if failure is not None
                    else f"rank {self.global_rank}: hora stopped before {handle.name!r} completed"))
        return True

    def report_wait(self, handle: Handle, waited: float) -> None:
        """Say on this rank what a handle waited on for ``waited`` seconds is waiting for (the
        waiting side's stall report: it names the tensor even where no coordinator sees it)."""
        where = "its result"
        with self._lock:
            for state in self._sets.values():
                request = state.in_flight.get(handle.name)
                if request is None or request.handle is not handle:
                    continue
                if request.name in state.awaiting:
                    where = f"the other ranks of process set {state.set_id} to submit it"
                elif any(r is request for r in state.by_bit.values()):
                    where = f"the other ranks of process set {state.set_id} (cached request)"
                else:
                    where = "the engine to negotiate it"
                break
        logger.warning("rank %d: collective %r has waited %.0f s for %s", self.global_rank, handle.name,
                       waited, where)

    # ---- the cycle ----------------------------------------------------------------------------

    @property
    def thread(self) -> threading.Thread:
        """The background thread that runs cycles nobody waits on (its CPU clock is what benchmarks read)."""
        return self._pacer.thread

    def drive(self, handle: Handle) -> None:
        """Run cycles in a thread that waits on ``handle`` until it completes (:meth:`Pacer.drive`)."""
        self._pacer.drive(handle)

    def iterate(self) -> None:
        """One cycle of every process set (the caller holds the pacer's ``cycle_lock``)."""
        self.progress = False
        try:
            if self.timeline is not None:
                self.timeline.cycle()
            stop = False
            for state in self._states:
                if state.set_id in self._sets and self._cycle(state):  # (a cycle may remove a set)
                    stop = True
            tuner = self.autotuner
            if tuner is not None and tuner.sample_done and not stop:
                tuner.end_sample()  # the same cycle on every rank: they executed the same operations
            if stop:
                self.stop(HorovodInternalError(
                    f"rank {self.global_rank}: hora was shut down (a rank called shutdown() or exited) while "
                    "this collective was pending: every rank must finish its collectives, on every process "
                    "set, before any rank shuts down"), orderly=True)
        except HorovodInternalError as exc:
            logger.error("%s", exc)  # the message already names the rank
            self.stop(exc)
        except Exception as exc:  # a bug must fail handles, not hang them
            logger.exception("rank %d: engine cycle crashed", self.global_rank)
            self.stop(HorovodInternalError(f"rank {self.global_rank}: engine cycle crashed: {exc!r}"))
        except BaseException:
            # KeyboardInterrupt (or SystemExit) in a driving thread, mid-collective: the peers
            # cannot be told where this rank stopped, so the engine cannot go on.
            self.stop(HorovodInternalError(f"rank {self.global_rank}: interrupted during a collective"))
            raise

    def stop(self, error: HorovodInternalError, orderly: bool = False) -> None:
        """Stop cycling and fail what is pending. ``orderly``: every rank agreed to shut down (else
        a failure: a peer may be gone mid-collective, so NCCL communicators are aborted now)."""
        self.stopped = True
        if not orderly:
            self._failed = True
            self._abort_device(error)
        self._fail_all(error)  # (after a device abort: already failed, with its note)
        self._pacer.wake.set()  # the engine thread exits

    def _abort_device(self, error: HorovodInternalError) -> None:
        """Abort the NCCL communicators at once: their kernels wait for a failed peer forever, and so
        would the framework's next GPU sync. Pending requests fail, with the abort named in the
        error, before the kernels are released: a thread the abort releases from a GPU sync may
        submit at once, and must find the engine failed."""
        if self.device_context is None:
            return

        def announce(note: str) -> None:
            self._fail_all(HorovodInternalError(f"{error}; {note}"))

        try:
            self.device_context.abort(str(error), announce)
        except Exception as exc:  # the failure stands; what went wrong aborting it is logged
            logger.warning("rank %d: aborting the NCCL communicators failed: %r", self.global_rank, exc)

    def inbox_pending(self) -> bool:
        return any(not s.inbox.empty() or s.uncached for s in self._states)

    def has_work(self) -> bool:
        return self.stop_requested or any(
            not s.inbox.empty() or s.uncached or s.by_bit or s.awaiting or s.executor.device_waiting
            for s in self._states
        )

    def _drain(self, state: SetState, now: float) -> None:
        use_cache = state.cache.enabled and not state.joined
        inbox = state.inbox
        by_bit = state.by_bit
        lookup = state.cache.lookup
        while not inbox.empty():
            request = inbox.get_nowait()  # only this thread (the cycle-lock holder) takes from it
            self.progress = True
            if not use_cache or request.signature.kind in _NEVER_CACHED:
                state.uncached.append(request)
                continue
            status, bit = lookup(request.name, request.signature)
            if status is Lookup.HIT:
                by_bit[bit] = request
                state.arrived = True
            else:
                if status is Lookup.INVALID:
                    state.invalid.add(bit)
                state.uncached.append(request)
        # A cached request that waits too long is renegotiated by name, so the stall inspector sees it.
        # (by_bit holds requests in submission order, so the first is the oldest.)
        warn_after = self.settings.stall_warning_s
        if self.settings.stall_check and by_bit and now - next(iter(by_bit.values())).submitted_at > warn_after:
            for bit, request in list(by_bit.items()):
                if now - request.submitted_at > warn_after:
                    state.invalid.add(bit)
        # A grouped collective travels as one unit: when one member goes by name, all of them do, and
        # invalidating their bits makes every other rank renegotiate the whole group by name too.
        if state.by_bit and (state.uncached or state.invalid):
            named = {r.signature.group for r in state.uncached if r.signature.group}
            named.update(state.by_bit[b].signature.group for b in state.invalid if b in state.by_bit)
            named.discard("")
            for bit, request in list(state.by_bit.items()):
                if request.signature.group in named:
                    state.invalid.add(bit)

    def _cycle(self, state: SetState) -> bool:
        """One negotiation cycle of one process set; True when the job is shutting down."""
        now = time.monotonic()
        self._poll_device(state)
        self._drain(state, now)
        flags = 0
        coordinator_due = (
            state.coordinator is not None
            and state.coordinator.has_pending
            and now - state.last_round > 0.5
        )
        if state.uncached or coordinator_due:
            flags |= _FLAG_UNCACHED
        if self.stop_requested:
            flags |= _FLAG_SHUTDOWN
        if self._device_failure is not None:
            flags |= _FLAG_DEVICE_FAILED
        if state.arrived:
            state.arrived = False
            if state.comm.rank < _ARRIVAL_MEMBERS:
                flags |= 1 << (_ARRIVAL_SHIFT + state.comm.rank)
        ready_mask = 0
        for bit in state.by_bit:
            ready_mask |= 1 << bit
        invalid_mask = 0
        for bit in state.invalid:
            invalid_mask |= 1 << bit
        flags_any, invalid_mask, ready_mask = _exchange_control(
            state.comm, state.cache.words, flags, invalid_mask, ready_mask, state.control)
        if flags_any & _FLAG_DEVICE_FAILED:
            raise self._device_failure or HorovodInternalError(
                f"rank {self.global_rank}: another rank of process set {state.set_id} stopped: its NCCL work "
                "failed or stalled")
        if flags_any & _FLAG_SHUTDOWN:
            # Device items a peer has completed complete here too before pending requests fail.
            state.executor.poll_device(finish=True)
            return True
        state.invalid.clear()

        # Cached tensors ready on every member run first, in bit order (the same on every member).
        items = []
        ready_mask &= ~invalid_mask
        by_bit = state.by_bit
        cache = state.cache
        while ready_mask:
            low = ready_mask & -ready_mask
            bit = low.bit_length() - 1
            ready_mask ^= low
            items.append(Item(cache.response(bit), by_bit.pop(bit), True))
        while invalid_mask:
            low = invalid_mask & -invalid_mask
            bit = low.bit_length() - 1
            invalid_mask ^= low
            cache.evict_bit(bit)
            request = by_bit.pop(bit, None)
            if request is not None:
                state.uncached.append(request)
        if items:
            for item in items:
                cache.touch(item.response.name)
            timeline = self.timeline
            if timeline is not None and state.set_id == 0:
                self._trace_cached_negotiation(timeline, state, items, flags_any)
            self._execute(state, items)
            self.progress = True
        self.idle_cycles = 0 if self.progress or self.has_work() else self.idle_cycles + 1

        if flags_any & _FLAG_UNCACHED:
            return self._negotiate(state, now)
        return False

    def _poll_device(self, state: SetState) -> None:
        """Complete device items the GPU has finished. Device work that cannot finish (its runner
        has aborted NCCL) is told to the other members in this cycle's exchange, and every member
        stops there, so none waits out a timeout on one whose engine stopped."""
        try:
            if state.executor.poll_device():
                self.progress = True
        except HorovodInternalError as exc:
            if self._device_failure is None:
                self._device_failure = exc

    def _trace_cached_negotiation(self, timeline: Timeline, state: SetState, items: list[Item],
                                  flags_any: int) -> None:
        """Give cache-served tensors the negotiation span name-negotiated ones get: from this rank's
        submission to now, with the members that readied tensors this cycle marked as arriving now
        (the late ones, when this rank had been waiting)."""
        arrived = flags_any >> _ARRIVAL_SHIFT
        late = [state.members[m] for m in range(min(len(state.members), _ARRIVAL_MEMBERS)) if arrived >> m & 1]
        for item in items:
            request = item.own_request()  # a cached tensor this rank readied
            timeline.cached_negotiation(request.name, request.signature.kind.value, request.submitted_at,
                                        state.members[state.comm.rank], late, len(state.members))

    def _negotiate(self, state: SetState, now: float) -> bool:
        self.negotiation_rounds += 1
        sending = state.uncached
        state.uncached = []
        for sent in sending:
            state.awaiting[sent.name] = sent
        gathered = state.comm.gather_object([(r.name, r.signature) for r in sending], 0)
        plan = None
        coordinator = state.coordinator
        if coordinator is not None:
            assert gathered is not None  # the coordinator's rank is the one that gathers
            state.last_round = now
            tl = self.timeline if state.set_id == 0 else None
            for member, signatures in enumerate(gathered):
                if tl is not None:
                    for name, sig in signatures:
                        # Opened by the first report the timeline sees (it may have started
                        # after other ranks' reports of this name reached the coordinator).
                        kind = sig.kind.value
                        if sig.kind != Kind.JOIN and not tl.is_open(name, f"NEGOTIATE_{kind}"):
                            tl.negotiate_start(name, kind)
                        tl.negotiate_rank_ready(name, state.members[member])
                coordinator.submit(member, signatures, now)
            responses = coordinator.ready()
            if tl is not None:
                for response in responses:
                    if response.signature.kind != Kind.JOIN:
                        tl.negotiate_end(response.name, response.signature.kind.value)
            fatal = None
            if self.settings.stall_check:
                report = coordinator.stalls(now, self.settings.stall_warning_s, self.settings.stall_shutdown_s)
                for warning in report.warnings:
                    logger.warning("stall: %s", warning)
                fatal = report.fatal
            plan = (responses, coordinator.joined, fatal)
        responses, joined, fatal = state.comm.broadcast_object(plan, 0)
        state.joined = tuple(joined)
        if state.joined and state.by_bit:
            # A joined member sets no cache bits: everything goes by name until all have joined.
            state.uncached.extend(state.by_bit.values())
            state.by_bit.clear()
        if fatal:
            raise HorovodInternalError(f"rank {self.global_rank}: {fatal}")
        items = []
        for response in responses:
            if response.signature.kind == Kind.JOIN:
                request = next(
                    (r for r in list(state.awaiting.values()) if r.signature.kind == Kind.JOIN), None
                )
                if request is not None:
                    state.awaiting.pop(request.name)
                # Every rank is back in step: unnamed collectives count from zero again (before the
                # join's handle completes, so the caller's next unnamed collective sees it).
                self._name_counters = {}
                self._join_epoch += 1
            else:
                request = state.awaiting.pop(response.name, None)
            items.append(Item(response, request))
        if items:
            self.progress = True
            self._execute(state, items)
        return False

    def _execute(self, state: SetState, items: list[Item]) -> None:
        tuner = self.autotuner
        if tuner is not None and state.set_id == 0 and tuner.active:
            tuner.executed([item.response.name for item in items],
                           sum(item.request.buffer.nbytes for item in items
                               if item.request is not None and item.request.buffer is not None))
        runnable: list[Item] = []
        for item in items:
            if item.response.signature.kind in PROCESS_SET_KINDS and item.response.error is None:
                if runnable:
                    state.executor.run(runnable)
                    runnable = []
                self._apply_process_set(state, item)
            else:
                runnable.append(item)
        if runnable:
            state.executor.run(runnable)

    def _finished(self, state: SetState, items: list[Item]) -> None:
        """Bookkeeping for executed items, done before their handles complete."""
        names = []
        for item in items:
            request = item.request
            if request is None:
                continue
            names.append(request.name)
            if not item.from_cache and item.response.cacheable:
                evicted = state.cache.put(item.response, request.signature)
                # A request may still be waiting on the bit the cache just reused: renegotiate it by name.
                if evicted is not None:
                    waiting = state.by_bit.get(evicted)
                    if waiting is not None and not state.cache.has_bit(evicted, waiting.name):
                        state.by_bit.pop(evicted)
                        state.uncached.append(waiting)
        if names:
            in_flight = state.in_flight
            with self._lock:
                for name in names:
                    in_flight.pop(name, None)

    def _apply_process_set(self, state: SetState, item: Item) -> None:
        sig = item.response.signature
        if sig.kind == Kind.ADD_PROCESS_SET:
            members = list(sig.set_ranks)
            set_id = self._next_set_id
            self._next_set_id += 1
            comm = None
            if self.global_rank in members:
                comm = self._make_communicator(members.index(self.global_rank), members, f"ps{set_id}")
            with self._lock:
                self._add_set(set_id, members, comm)
            self._finished(state, [item])
            if item.request is not None:
                item.request.handle.set_result(set_id)
        else:
            set_id = sig.set_id
            with self._lock:
                existed = self._known_sets.pop(set_id, None) is not None
                removed = self._sets.pop(set_id, None)
                if removed is not None:
                    self._states = tuple(self._sets[k] for k in sorted(self._sets))
                    self._removed_bytes_sent.append(removed.comm.bytes_sent)
                    # Nothing will ever run these: fail them rather than leave their waiters hanging.
                    self._fail_requests(
                        list(removed.in_flight.values()),
                        f"rank {self.global_rank}: process set {set_id} was removed while this "
                        "collective was pending on it (every member must finish its collectives "
                        "on a process set before removing it)")
                    removed.in_flight.clear()
            if removed is not None:
                removed.comm.close()
                if self.device_context is not None:
                    self.device_context.release(set_id)
            self._finished(state, [item])
            if item.request is not None:
                item.request.handle.set_result(existed)
