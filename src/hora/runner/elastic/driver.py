"""The elastic driver: keeps a job's world formed on whatever hosts are usable, until training ends.

A fixed-size job ends at the first failed worker. An elastic job instead re-forms its world, in the
same surviving worker processes, through a new rendezvous round (:mod:`hora.rendezvous.rounds`):

- **Hosts.** A background thread asks the :class:`~hora.runner.elastic.discovery.HostDiscovery` every
  ``discovery_interval`` seconds. A failed poll is logged (once per distinct error) and the last good
  answer stands. The :class:`~hora.runner.elastic.hosts.HostRegistry` removes blacklisted hosts.
- **Rounds.** Whenever the usable hosts give a plan (:func:`~hora.runner.elastic.hosts.plan_world`)
  other than the current world's, the driver first writes a host-update announcement
  (:mod:`hora.elastic.notification`; running workers raise ``HostsUpdatedInterrupt`` at their next
  commit), then opens the next round with the new plan, superseding any round still forming, and
  starts a worker for every slot of the plan that has none. Survivors join the new round when they
  reset; workers whose slot is no longer in the plan find no rank in it and exit with status 0
  (:class:`hora.runtime.NotInRoundError`), and any still running once the new world has formed are
  stopped.
- **Failures.** A worker that exits non-zero before the job finishes is not the end of the job: its
  host is blacklisted, the other workers on that host are stopped, and the world re-forms without
  it. Survivors see the failure as ``HorovodInternalError`` and roll back to their last commit.
- **Bounds.** Fewer usable slots than ``min_np`` for ``elastic_timeout`` seconds ends the job, as
  does a round that does not form within ``elastic_timeout``, and the reset after ``reset_limit``
  resets. With a fixed host list and no cooldown, losing too many hosts ends it at once: nothing can
  bring them back. Each ends with one line saying which bound and why, naming the last failed worker.
- **The end.** The first worker to exit with status 0 means training is over: no new round opens, the
  driver waits for the rest of the world to exit, and a failure now fails the job.

How a worker is started is the :class:`WorkerLauncher`'s business: :class:`JobLauncher` starts
processes here and over SSH for ``hora run`` and :func:`hora.run` (their output lines are prefixed with
the worker's number in start order, since ranks change from one round to the next), and
:mod:`hora.ray.elastic` starts Ray actors. The driver only needs the job's rendezvous store and, for each
worker, something it can wait on and stop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from hora import config
from hora.elastic.notification import HostsUpdate, announce_hosts_update, read_hosts_update
from hora.errors import ConfigError, HoraError, LaunchError
from hora.rendezvous import KeyValueStore
from hora.rendezvous.rounds import Round
from hora.runner.elastic.discovery import DiscoveryError, HostDiscovery
from hora.runner.elastic.hosts import HostRegistry, Plan, describe_plan, plan_size, plan_slots, plan_world
from hora.runner.launching.exits import ExitWatcher
from hora.runner.launching.job import Job
from hora.runner.launching.launch import JobOutcome, WorkerExit, _explained, _SignalTrap, start_worker
from hora.runner.launching.locality import is_local_host
from hora.runner.launching.process import describe_returncode, signal_name
from hora.workers.hosts import SlotInfo

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
_AFTER_KILL_SECONDS = 10.0
_OUTPUT_DRAIN_SECONDS = 5.0


@dataclass(frozen=True)
class ElasticSettings:
    """An elastic job's bounds: ``np`` slots to start with, between ``min_np`` and ``max_np`` (None:
    as many as the hosts offer), and how long and how often it may re-form."""

    min_np: int
    max_np: int | None
    np: int
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None
    discovery_interval: float = 1.0
    removal_grace: float = 0.0

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ConfigError(f"--min-np must be at least 1, got {self.min_np}")
        if self.max_np is not None and self.min_np > self.max_np:
            raise ConfigError(f"--min-np {self.min_np} is greater than --max-np {self.max_np}")
        if self.np < self.min_np or (self.max_np is not None and self.np > self.max_np):
            bounds = f"[{self.min_np}, {self.max_np if self.max_np is not None else 'any'}]"
            raise ConfigError(f"-np {self.np} is outside the elastic bounds --min-np/--max-np {bounds}")
        if self.elastic_timeout <= 0:
            raise ConfigError(f"--elastic-timeout must be positive, got {self.elastic_timeout:g}")


class WorkerProcess(Protocol):
    """A started worker as the driver sees it (a local or SSH process, a Ray actor)."""

    def describe(self) -> str: ...

    def wait(self) -> tuple[int, str | None]:
        """Block until the worker ends: its exit status (0: it finished or left the world) and, when
        it failed, a line saying how."""
        ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def alive(self) -> bool: ...


class WorkerLauncher(Protocol):
    """Starts the workers of one elastic job and owns what they share: the store and their output."""

    @property
    def store(self) -> KeyValueStore: ...

    @property
    def kill_grace(self) -> float:
        """Seconds a terminated worker gets before it is killed."""
        ...

    def start(self, slot: SlotInfo, env: Mapping[str, str], number: int) -> WorkerProcess:
        """Start worker ``number`` (start order) for ``slot`` with the driver's extra ``env``;
        :class:`hora.errors.LaunchError` when the slot's host cannot take it."""
        ...

    def drain_output(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the workers' output to be forwarded; False if some was still open."""
        ...

    def explain(self, failure: WorkerExit, number: int) -> WorkerExit:
        """``failure`` (of worker ``number``) with the reason its output gives, where it gives one."""
        ...


class JobLauncher:
    """Workers as processes of a :class:`~hora.runner.launching.job.Job`: here, or over SSH on other hosts."""

    def __init__(self, job: Job) -> None:
        self.job = job

    @property
    def store(self) -> KeyValueStore:
        return self.job.store

    @property
    def kill_grace(self) -> float:
        return self.job.kill_grace

    def start(self, slot: SlotInfo, env: Mapping[str, str], number: int) -> WorkerProcess:
        if self.job.local_only and not is_local_host(slot.hostname):
            raise LaunchError(f"cannot start a worker on {slot.hostname}: the job's rendezvous store listens "
                              "on loopback only, since every host was this machine when the job started "
                              "(give --network-interfaces to listen on the network)")
        return start_worker(self.job.spec_for(slot, env), self.job.router, number)

    def drain_output(self, timeout: float) -> bool:
        return self.job.router.join(timeout)

    def explain(self, failure: WorkerExit, number: int) -> WorkerExit:
        # The router knows the worker by its number; the failure names its rank at the time.
        found = _explained(replace(failure, rank=number), self.job.router)
        return replace(failure, reason=found.reason)


@dataclass
class _Worker:
    """One worker the driver started, and what became of it."""

    number: int
    host: str
    slot: int
    process: WorkerProcess
    rank: int  # its rank in the round it was last assigned to
    retired: str | None = None  # why it no longer belongs to the world (None: it does)
    in_world: bool = False  # a round it belongs to has formed: it holds the training state
    returncode: int | None = None
    detail: str | None = None

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def describe(self) -> str:
        return f"rank {self.rank} on {self.host} (worker {self.number}, {self.process.describe()})"


@dataclass
class ElasticOutcome(JobOutcome):
    """How an elastic job ended: :class:`JobOutcome` plus the driver's own reason and counters."""

    error: str | None = None
    resets: int = 0
    rounds: list[Round] = field(default_factory=list)
    # The last round that formed: the world training ended in (None: none ever formed).
    world: Round | None = None
    # Start numbers of the workers of that world, once training finished (whose results count).
    final_workers: list[int] = field(default_factory=list)
    failures: list[WorkerExit] = field(default_factory=list)
    # The start number of the worker behind each entry of ``failures``, and behind ``failure``.
    failure_workers: list[int] = field(default_factory=list)
    failure_worker: int | None = None
    # Seconds from a failure being seen to the next world forming, one per failure-driven reset.
    recovery_seconds: list[float] = field(default_factory=list)

    @property
    def succeeded(self) -> bool:
        return self.failure is None and self.error is None and self.signal is None

    def final_results(self, returned: Mapping[int, tuple[int, Any]], where: str) -> list[Any]:
        """Each rank's result of the final world, in rank order, from ``returned``: worker number ->
        (rank it ended with, value) for the workers that returned one. Only the final world's
        workers count, so a worker that left or finished in an older round cannot stand in for a
        rank; :class:`HoraError` names the ranks that returned nothing."""
        size = self.world.size if self.world is not None else 0
        by_rank = {returned[number][0]: returned[number][1] for number in self.final_workers if number in returned}
        missing = [rank for rank in range(size) if rank not in by_rank]
        if missing:
            raise HoraError(f"{where}: the job ended but ranks {missing} of the final world ({size} ranks) "
                            "returned no result")
        return [by_rank[rank] for rank in range(size)]

    @property
    def exit_code(self) -> int:
        if self.signal is None and self.failure is None and self.error is not None:
            return 1
        return super().exit_code

    def message(self) -> str | None:
        if self.signal is not None or self.failure is not None:
            return super().message()
        if self.error is None:
            return None
        if self.failures:
            return f"{self.error}; the last worker failure: {self.failures[-1].description}"
        return self.error


class ElasticDriver:
    """Runs one elastic job until it ends; see the module doc. ``launcher`` starts the workers (a
    :class:`~hora.runner.launching.job.Job`, entered so its store is up, stands for its :class:`JobLauncher`)."""

    def __init__(self, launcher: WorkerLauncher | Job, discovery: HostDiscovery, settings: ElasticSettings,
                 handle_signals: bool = False) -> None:
        self.launcher: WorkerLauncher = JobLauncher(launcher) if isinstance(launcher, Job) else launcher
        self.discovery = discovery
        self.settings = settings
        self.registry = HostRegistry(settings.cooldown_range, removal_grace=settings.removal_grace)
        self.outcome = ElasticOutcome(size=0)
        self._handle_signals = handle_signals
        self._workers: dict[int, _Worker] = {}
        self._exits: queue.Queue[tuple[int, int, str | None]] = queue.Queue()
        self._exited = threading.Event()  # set with every exit put on _exits
        self._watcher = ExitWatcher(self._exit_seen)  # one thread for every worker's exit
        self._plan: Plan = ()
        self._round: Round | None = None
        self._round_opened = 0.0
        self._formed: set[int] = set()
        self._finishing = False
        self._failed_since_round = False
        self._failure_seen_at: float | None = None
        self._short_since: float | None = None
        self._announcements = 0
        self._discovered: dict[str, int] | None = None
        self._discovery_lock = threading.Lock()
        self._discovery_event = threading.Event()
        self._stop = threading.Event()
        self._last_discovery_error: str | None = None
        self._failure_numbers: dict[int, int] = {}  # id(WorkerExit) -> the worker's number

    # ---- discovery -------------------------------------------------------------------------------

    def _poll_discovery(self) -> None:
        while not self._stop.is_set():
            try:
                found = self.discovery.find()
            except DiscoveryError as exc:
                if str(exc) != self._last_discovery_error:
                    logger.warning("host discovery failed (keeping the hosts last found, retrying every "
                                   "%g s): %s", self.settings.discovery_interval, exc)
                self._last_discovery_error = str(exc)
            else:
                if self._last_discovery_error is not None:
                    logger.warning("host discovery works again")
                self._last_discovery_error = None
                with self._discovery_lock:
                    changed = found != self._discovered
                    self._discovered = found
                if changed:
                    logger.info("discovered hosts: %s", describe_plan(tuple(found.items())))
                self._discovery_event.set()
            self._stop.wait(self.settings.discovery_interval)

    def _refresh_hosts(self) -> None:
        with self._discovery_lock:
            if self._discovered is not None:
                self.registry.update(self._discovered)

    # ---- running ---------------------------------------------------------------------------------

    def run(self) -> ElasticOutcome:
        """Start, supervise and re-form until the job ends; never leaves a worker running."""
        poller = threading.Thread(target=self._poll_discovery, name="hora-discovery", daemon=True)
        with _SignalTrap(self._handle_signals) as trap:
            self._trap = trap
            poller.start()
            try:
                self._supervise()
            finally:
                self._stop.set()
                close = getattr(self.discovery, "close", None)
                if callable(close):
                    close()  # a discovery script still running must not outlive the job
                self._stop_everyone()
                self._watcher.close()
                if not self.launcher.drain_output(_OUTPUT_DRAIN_SECONDS):
                    logger.warning("some worker output pipes were still open after %.0f s",
                                   _OUTPUT_DRAIN_SECONDS)
        poller.join(timeout=1.0)
        self._explain_failures()
        return self.outcome

    def _supervise(self) -> None:
        deadline = time.monotonic() + self.settings.elastic_timeout
        while not self._discovery_event.wait(_POLL_SECONDS):  # the first answer
            if self._interrupted():
                return
            if time.monotonic() > deadline:
                self._end(f"host discovery gave no usable answer within {self.settings.elastic_timeout:g} s "
                          f"(--elastic-timeout){self._discovery_error_suffix()}")
                return
        started_waiting = time.monotonic()
        while True:
            if self._interrupted() or self.outcome.error is not None:
                return
            self._handle_exits()
            if self.outcome.error is not None or self.outcome.failure is not None:
                return
            if self._finishing:
                if not any(w.alive and w.retired is None for w in self._workers.values()):
                    logger.info("every worker of the final world has exited: the job is done")
                    return
                self._wait_for_exit()
                continue
            self._refresh_hosts()
            target = plan_world(self.registry.usable(), self._plan, self.settings.max_np)
            # At the start, wait up to --elastic-timeout for -np slots when more hosts may appear,
            # then start with what there is; a fixed host list never offers more than it does now.
            waiting_for_np = (self._round is None and not self.discovery.static
                              and time.monotonic() - started_waiting <= self.settings.elastic_timeout)
            needed = self.settings.np if waiting_for_np else self.settings.min_np
            if target != self._plan or self._round is None:
                if self._round is not None and self._reset_limit_reached(target):
                    return  # no reset left: waiting for slots (or a blacklisted host) gains nothing
                if plan_size(target) < needed:
                    self._wait_for_slots(target, needed)
                else:
                    self._short_since = None
                    self._open_round(target)
            else:
                self._short_since = None
            self._watch_round()
            self._wait_for_exit()

    def _interrupted(self) -> bool:
        if self._trap.received is None:
            return False
        self.outcome.signal = self._trap.received
        logger.info("launcher received %s", signal_name(self._trap.received))
        return True

    def _wait_for_exit(self) -> None:
        """Sleep until a worker exits (handled, in order, by the next _handle_exits) or a poll passes."""
        if self._exited.wait(_POLL_SECONDS * 2):
            self._exited.clear()

    def _end(self, error: str) -> None:
        if self.outcome.error is None:
            # Said once, by whoever reports the outcome (hora run's last line, hora.run's exception).
            self.outcome.error = error
            logger.debug("%s", error)

    def _discovery_error_suffix(self) -> str:
        return f" (last discovery error: {self._last_discovery_error})" if self._last_discovery_error else ""

    # ---- too few slots -------------------------------------------------------------------------------

    def _wait_for_slots(self, target: Plan, needed: int) -> None:
        now = time.monotonic()
        have = plan_size(target)
        timeout = self.settings.elastic_timeout
        blacklisted = [h for h in self.registry.discovered if self.registry.is_blacklisted(h)]
        if self.discovery.static and not self.registry.cooling_down() and self._round is not None:
            self._end(f"elastic job stops: only {have} slot(s) are left ({describe_plan(target)}), fewer "
                      f"than --min-np {self.settings.min_np}, and the hosts are fixed "
                      f"(blacklisted for good: {', '.join(blacklisted) or 'none'})")
            return
        if self._short_since is None:
            self._short_since = now
            logger.warning("only %d usable slot(s) (%s), %d needed; waiting up to %g s for more hosts",
                           have, describe_plan(target), needed, timeout)
        elif now - self._short_since > timeout:
            self._end(f"elastic job stops: fewer than {needed} usable slot(s) for {timeout:g} s "
                      f"(--elastic-timeout; usable: {describe_plan(target)}; blacklisted: "
                      f"{', '.join(blacklisted) or 'none'}){self._discovery_error_suffix()}")

    # ---- rounds ----------------------------------------------------------------------------------

    def _reset_limit_reached(self, target: Plan) -> bool:
        """Whether re-forming the world once more would pass --reset-limit (the job then ends)."""
        limit = self.settings.reset_limit
        if limit is None or self.outcome.resets < limit:
            return False
        self._end(f"elastic job stops: the world needs re-forming again (hosts now {describe_plan(target)}) "
                  f"but it was already re-formed {self.outcome.resets} time(s), the --reset-limit")
        return True

    def _open_round(self, target: Plan) -> None:
        first = self._round is None
        if not first:
            if self._reset_limit_reached(target):
                return
            self.outcome.resets += 1
            # The state sync may be skipped only if every worker of the new world already holds
            # the state: none is new, and none was started for a round that never formed.
            holding = {(w.host, w.slot) for w in self._live() if w.in_world}
            added = any((s.hostname, s.local_rank) not in holding for s in plan_slots(target))
            self._announce(skip_sync=not added and not self._failed_since_round)
        store = self.launcher.store
        # The round records the announcement it reflects, so its workers react to every later one,
        # including one made before their first commit.
        last = read_hosts_update(store)
        opened = store.open_round(plan_size(target), target, supersede=True,
                                  announcement=-1 if last is None else last.id)
        self._round, self._plan, self._round_opened = opened, target, time.monotonic()
        self._failed_since_round = False
        self.outcome.rounds.append(opened)
        self.outcome.size = opened.size
        logger.info("rendezvous round %d: %d rank(s) on %s", opened.generation, opened.size,
                    describe_plan(target))
        by_slot = {(w.host, w.slot): w for w in self._live()}
        for slot in plan_slots(target):
            worker = by_slot.pop((slot.hostname, slot.local_rank), None)
            if worker is not None:
                worker.rank = slot.rank
                continue
            self._start(slot)
        for worker in by_slot.values():  # live, but the new plan has no place for them
            worker.retired = "its host or slot left the job"
            logger.info("%s is not part of round %d; it leaves when it next re-forms", worker.describe(),
                        opened.generation)

    def _announce(self, skip_sync: bool) -> None:
        store = self.launcher.store
        last = read_hosts_update(store)
        self._announcements = max(self._announcements, -1 if last is None else last.id) + 1
        announce_hosts_update(store, HostsUpdate(self._announcements, skip_sync))

    def _start(self, slot: SlotInfo) -> None:
        number = len(self._workers)
        env = config.env_for("elastic", "1")
        env.update(config.env_for("start_timeout", max(float(config.get("start_timeout")),
                                                        self.settings.elastic_timeout)))
        try:
            process = self.launcher.start(slot, env, number)
        except LaunchError as exc:
            self._host_failed(slot.hostname, str(exc))
            return
        worker = _Worker(number, slot.hostname, slot.local_rank, process, slot.rank)
        self._workers[number] = worker
        self.outcome.returncodes[number] = None
        self._watcher.watch(number, process)

    def _exit_seen(self, number: int, returncode: int, detail: str | None) -> None:
        self._exits.put((number, returncode, detail))
        self._exited.set()

    def _watch_round(self) -> None:
        current = self._round
        if current is None or current.generation in self._formed:
            return
        now = self.launcher.store.get_round(current.generation)
        if now is not None and now.complete:
            self._formed.add(current.generation)
            self.outcome.world = current
            logger.info("rendezvous round %d formed: %d rank(s) in %.1f s", current.generation, current.size,
                        time.monotonic() - self._round_opened)
            if self._failure_seen_at is not None:
                self.outcome.recovery_seconds.append(time.monotonic() - self._failure_seen_at)
                self._failure_seen_at = None
            for worker in self._workers.values():
                if worker.alive and worker.retired is not None:
                    worker.process.terminate()
                elif worker.retired is None:  # one that already finished was in this world too
                    worker.in_world = True
        elif time.monotonic() - self._round_opened > self.settings.elastic_timeout:
            joined = {rank for rank, _ in (now.members if now else ())}
            missing = [w.describe() for w in self._live() if w.rank not in joined]
            self._end(f"elastic job stops: rendezvous round {current.generation} did not form within "
                      f"{self.settings.elastic_timeout:g} s (--elastic-timeout); not joined: "
                      f"{'; '.join(missing) or 'workers not started'}")

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers.values() if w.alive and w.retired is None]

    # ---- exits -----------------------------------------------------------------------------------

    def _handle_exits(self) -> None:
        while True:
            try:
                number, returncode, detail = self._exits.get_nowait()
            except queue.Empty:
                return
            worker = self._workers[number]
            worker.returncode, worker.detail = returncode, detail
            self.outcome.returncodes[number] = returncode
            if worker.retired is not None:
                logger.info("%s (%s) %s", worker.describe(), worker.retired, describe_returncode(returncode))
                continue
            if returncode == 0:
                if not self._finishing:
                    logger.info("%s finished: training is over; waiting for the rest of the world",
                                worker.describe())
                    self._finish()
                continue
            failure = WorkerExit(worker.rank, worker.host, returncode, detail)
            self.outcome.failures.append(failure)
            self.outcome.failure_workers.append(worker.number)
            self._failure_numbers[id(failure)] = worker.number
            worker.retired = "failed"
            if self._finishing:
                self.outcome.failure = failure
                self.outcome.failure_worker = worker.number
                return
            self._host_failed(worker.host, f"{worker.describe()} {detail or describe_returncode(returncode)}")

    def _finish(self) -> None:
        """Training is over: the world that formed last is the final one. Workers started for a
        round that has not formed (hosts that came too late) never hold the state and would wait
        for peers that are done, so they are stopped now."""
        self._watch_round()  # a round that formed a moment ago counts
        self._finishing = True
        for worker in self._workers.values():
            if worker.alive and worker.retired is None and not worker.in_world:
                worker.retired = "training finished before its round formed"
                logger.info("%s: %s; stopping it", worker.describe(), worker.retired)
                worker.process.terminate()
        self.outcome.final_workers = [w.number for w in self._workers.values()
                                      if w.retired is None and w.in_world]
        if self.outcome.world is not None:
            self.outcome.size = self.outcome.world.size

    def _host_failed(self, host: str, why: str) -> None:
        self._failed_since_round = True
        if self._failure_seen_at is None:
            self._failure_seen_at = time.monotonic()
        delay = self.registry.blacklist(host)
        for_how_long = "for the rest of the job" if delay is None else f"for {delay:.0f} s"
        logger.warning("%s; blacklisting %s %s and re-forming the world without it", why, host, for_how_long)
        for worker in self._workers.values():
            if worker.host == host and worker.alive and worker.retired is None:
                worker.retired = f"its host {host} was blacklisted"
                worker.process.terminate()

    # ---- the end ---------------------------------------------------------------------------------

    def _stop_everyone(self) -> None:
        running = [w for w in self._workers.values() if w.alive or w.process.alive()]
        self.outcome.stopped = sum(1 for w in running if w.alive and w.retired is None)
        for worker in running:
            worker.process.terminate()
        deadline = time.monotonic() + self.launcher.kill_grace
        self._drain(deadline, running)
        for worker in running:
            if worker.process.alive():
                logger.info("%s survived the stop request; sending SIGKILL", worker.describe())
                worker.process.kill()
        self._drain(time.monotonic() + _AFTER_KILL_SECONDS, running)

    def _drain(self, deadline: float, workers: Sequence[_Worker]) -> None:
        while time.monotonic() < deadline and any(w.process.alive() for w in workers):
            try:
                number, returncode, detail = self._exits.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            worker = self._workers[number]
            worker.returncode, worker.detail = returncode, detail
            self.outcome.returncodes[number] = returncode

    def _explain_failures(self) -> None:
        """Add each failure's Python exception (read from its output, which is complete now)."""

        def explained(failure: WorkerExit) -> WorkerExit:
            number = self._failure_numbers.get(id(failure))
            return failure if number is None else self.launcher.explain(failure, number)

        self.outcome.failures = [explained(f) for f in self.outcome.failures]
        if self.outcome.failure is not None:
            self.outcome.failure = explained(self.outcome.failure)
