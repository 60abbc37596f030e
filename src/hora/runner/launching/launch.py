"""Supervising a job's worker processes, here and on remote hosts, until the job ends.

The rule (Horovod's): the first worker to fail, by a non-zero exit or a signal, ends the job. The
supervisor notices at once (one :class:`~hora.runner.launching.exits.ExitWatcher` thread holds every worker's
pidfd and reports exits to a queue; output is read by one thread too, so a 64-rank job costs the
launcher two threads, not 192), stops
every other worker, and reports which rank failed, where and how. A local worker is stopped by
SIGTERM to its process group, SIGKILL after the grace period; a remote one (started over SSH, see
:mod:`hora.runner.ssh.remote`) by closing its ssh channel's stdin, on which the remote wrapper does the
same there, and by killing the ssh client if that takes longer than the grace. A termination signal
to the launcher (Ctrl-C, SIGTERM, SIGHUP) stops every worker the same way. Whatever happens,
including an exception in the launcher itself, no worker or worker child is left running when
:func:`run_workers` returns (remote wrappers finish their own SIGKILL within the grace period).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any

from hora.errors import LaunchError
from hora.runner.launching.exits import ExitWatcher
from hora.runner.launching.output import OutputRouter
from hora.runner.launching.process import LocalWorker, describe_returncode, exit_status_for, signal_name
from hora.runner.ssh.remote import RemoteTarget, RemoteWorker

logger = logging.getLogger(__name__)

# How often the supervisor checks for a launcher signal while no worker has exited. Worker exits
# themselves are reported through a queue and are seen immediately.
_POLL_SECONDS = 0.05
# After SIGKILL a process is gone within milliseconds unless stuck in the kernel; don't hang on it.
_AFTER_KILL_SECONDS = 10.0
_OUTPUT_DRAIN_SECONDS = 5.0
_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
# Extra seconds a remote rank gets to stop: the wrapper's own grace runs on the far side of a network.
_REMOTE_SLACK_SECONDS = 3.0
# Python's exit status after an uncaught exception: only then is a traceback on stderr the reason.
_UNCAUGHT_EXCEPTION_STATUS = 1


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its rank, the host it belongs to, its command line and environment.

    ``remote`` says how to reach its host over SSH; None starts it here as a child process.
    """

    rank: int
    host: str
    argv: Sequence[str]
    env: Mapping[str, str]
    remote: RemoteTarget | None = None


@dataclass(frozen=True)
class WorkerExit:
    """How a worker ended; ``returncode`` follows Popen (negative: killed by that signal).

    ``detail`` replaces the plain wording when there is more to say (a remote rank that lost its
    SSH connection, or could not be started there). ``reason`` is the Python exception that ended
    the worker (``ValueError: bad input``), when its stderr showed one: an exit status alone does
    not tell a user which of their ranks' errors to look for.
    """

    rank: int
    host: str
    returncode: int
    detail: str | None = None
    reason: str | None = None

    @property
    def description(self) -> str:
        text = f"rank {self.rank} on {self.host} {self.detail or describe_returncode(self.returncode)}"
        return f"{text}: {self.reason}" if self.reason else text

    @property
    def exit_status(self) -> int:
        return exit_status_for(self.returncode)


@dataclass
class JobOutcome:
    """The end of a job: every worker's return code, the first failure, and what the launcher did."""

    size: int
    returncodes: dict[int, int | None] = field(default_factory=dict)
    failure: WorkerExit | None = None
    also_failed: list[WorkerExit] = field(default_factory=list)
    stopped: int = 0
    signal: int | None = None

    @property
    def exit_code(self) -> int:
        """0 on success; the failing worker's status (128+signum for signals); 128+signum if the
        launcher was signalled."""
        if self.signal is not None:
            return 128 + self.signal
        if self.failure is not None:
            return self.failure.exit_status
        return 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def message(self) -> str | None:
        """One line for the user, or None when every worker succeeded."""
        if self.signal is not None:
            return (f"received {signal_name(self.signal)}; stopped "
                    f"{_count(self.stopped, 'running worker')}")
        if self.failure is None:
            return None
        others = ""
        if self.also_failed:
            # Seen together with the first failure, before anything was stopped: with a dead peer
            # the survivors fail too, and which exit is noticed first is a race worth disclosing.
            others = "; also failed on their own: " + ", ".join(f.description for f in self.also_failed)
        return self.failure.description + others + self.stopped_suffix()

    def stopped_suffix(self) -> str:
        """``; stopped the other 3 workers`` (empty when no other worker was still running)."""
        if self.stopped == 1:
            return "; stopped the other worker"
        if self.stopped > 1:
            return f"; stopped the other {self.stopped} workers"
        return ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class _SignalTrap:
    """Records SIGINT/SIGTERM/SIGHUP instead of dying, so the supervisor can stop workers first.

    The handler only stores the signal (no locks: it may run at any bytecode of the main thread);
    the supervision loop polls it. A second signal (Ctrl-C pressed again) means "don't wait for the
    grace period": the supervisor then goes straight to SIGKILL.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self.impatient = False
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.impatient = True

    def __enter__(self) -> _SignalTrap:
        if self.enabled:
            for name in _STOP_SIGNALS:
                signum = getattr(signal, name, None)
                if signum is not None:
                    self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            # None means the previous handler was installed outside Python: restore the default.
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)


def start_worker(spec: WorkerSpec, router: OutputRouter, label: int) -> LocalWorker | RemoteWorker:
    """Start one worker and forward its output under ``label`` (its rank, in a fixed-size job).

    Raises :class:`LaunchError` naming the rank, host and reason when it cannot be started.
    """
    files = router.prepare_files(label)
    worker: LocalWorker | RemoteWorker
    try:
        if spec.remote is None:
            worker = LocalWorker(spec.argv, spec.env)
        else:
            worker = RemoteWorker(spec.rank, spec.host, spec.argv, spec.env, spec.remote)
    except OSError as exc:
        for handle in files.values():
            handle.close()
        reason = exc.strerror or str(exc)
        program = spec.argv[0] if spec.remote is None else spec.remote.ssh.command[0]
        raise LaunchError(f"cannot start rank {spec.rank} on {spec.host}: {reason}: {program!r}") from None
    logger.info("started rank %d on %s (%s): %s", spec.rank, spec.host, worker.describe(), " ".join(spec.argv))
    if isinstance(worker, RemoteWorker):
        done = router.attach(label, worker.stdout, worker.stderr, files, stderr_filter=worker.filter_stderr)
        worker.attach_stderr_done(done.get("stderr"))
    else:
        router.attach(label, worker.stdout, worker.stderr, files)
    return worker


class _Supervisor:
    def __init__(self, specs: Sequence[WorkerSpec], router: OutputRouter, kill_grace: float,
                 trap: _SignalTrap) -> None:
        self.specs = list(specs)
        self.hosts = {spec.rank: spec.host for spec in self.specs}
        self.trap = trap
        self.router = router
        self.kill_grace = kill_grace
        self.workers: dict[int, LocalWorker | RemoteWorker] = {}
        self.exits: queue.Queue[tuple[int, int, str | None]] = queue.Queue()
        self.running: set[int] = set()
        self.outcome = JobOutcome(size=len(self.specs))
        self.watcher: ExitWatcher[int] = ExitWatcher(lambda rank, code, detail: self.exits.put((rank, code, detail)))

    def start_all(self) -> None:
        for spec in self.specs:
            worker = start_worker(spec, self.router, spec.rank)
            self.workers[spec.rank] = worker
            self.running.add(spec.rank)
            self.outcome.returncodes[spec.rank] = None
            self.watcher.watch(spec.rank, worker)

    def _record(self, rank: int, returncode: int) -> None:
        self.running.discard(rank)
        self.outcome.returncodes[rank] = returncode
        logger.info("rank %d %s", rank, describe_returncode(returncode))

    def supervise(self) -> None:
        """Block until every worker succeeded, one failed, or the launcher was signalled."""
        trap = self.trap
        while self.running:
            if trap.received is not None:
                self.outcome.signal = trap.received
                logger.info("launcher received %s", signal_name(trap.received))
                return
            try:
                rank, returncode, detail = self.exits.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            self._record(rank, returncode)
            if returncode != 0:
                self.outcome.failure = WorkerExit(rank, self.hosts[rank], returncode, detail)
                self._record_pending_failures()
                return

    def _record_pending_failures(self) -> None:
        """Record exits already reported (none of them caused by us: nothing was stopped yet)."""
        while True:
            try:
                rank, returncode, detail = self.exits.get_nowait()
            except queue.Empty:
                return
            self._record(rank, returncode)
            if returncode != 0:
                self.outcome.also_failed.append(WorkerExit(rank, self.hosts[rank], returncode, detail))

    def _drain_exits(self, deadline: float, patient: bool = True) -> None:
        while self.running:
            if patient and self.trap.impatient:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                rank, returncode, _detail = self.exits.get(timeout=min(remaining, _POLL_SECONDS))
            except queue.Empty:
                continue
            self._record(rank, returncode)

    def stop_all(self) -> None:
        """Stop every worker that still runs (or left children behind); KILL what outlives the grace."""
        self.outcome.stopped = len(self.running)
        workers = self.workers
        for rank, worker in workers.items():
            # A finished local worker's group may still hold its children: stop those too.
            if rank in self.running or worker.alive():
                worker.terminate()
        grace = self.kill_grace
        if any(isinstance(workers[rank], RemoteWorker) for rank in self.running):
            grace += _REMOTE_SLACK_SECONDS
        deadline = time.monotonic() + grace
        self._drain_exits(deadline)
        while (time.monotonic() < deadline and not self.trap.impatient
               and any(worker.alive() for worker in workers.values())):
            time.sleep(_POLL_SECONDS)  # grandchildren are not our children: poll, bounded by grace
        for rank, worker in workers.items():
            if worker.alive():
                logger.info("rank %d (%s) survived the stop request for %.1f s; sending SIGKILL",
                            rank, worker.describe(), grace)
                worker.kill()
        self._drain_exits(time.monotonic() + _AFTER_KILL_SECONDS, patient=False)
        for rank in sorted(self.running):
            logger.warning("rank %d (%s) did not exit even after SIGKILL",
                           rank, workers[rank].describe())


def run_workers(
    specs: Sequence[WorkerSpec],
    router: OutputRouter | None = None,
    kill_grace: float = 5.0,
    handle_signals: bool = False,
) -> JobOutcome:
    """Start ``specs``, forward their output, and supervise them until the job ends.

    Returns the :class:`JobOutcome`; raises :class:`LaunchError` if a worker cannot be started
    (after stopping those already started). With ``handle_signals`` (main thread only), SIGINT,
    SIGTERM and SIGHUP to this process stop the workers and are reported in the outcome instead of
    killing the launcher outright.
    """
    router = router or OutputRouter(size=len(specs))
    with _SignalTrap(handle_signals) as trap:
        supervisor = _Supervisor(specs, router, kill_grace, trap)
        try:
            supervisor.start_all()
            supervisor.supervise()
        finally:
            supervisor.stop_all()
            supervisor.watcher.close()
            if not router.join(_OUTPUT_DRAIN_SECONDS):
                logger.warning("some worker output pipes were still open after %.0f s; "
                               "a worker's child may have escaped its process group",
                               _OUTPUT_DRAIN_SECONDS)
    outcome = supervisor.outcome
    if outcome.failure is not None:
        outcome.failure = _explained(outcome.failure, router)
        outcome.also_failed = [_explained(failed, router) for failed in outcome.also_failed]
    return outcome


def _explained(failure: WorkerExit, router: OutputRouter) -> WorkerExit:
    """``failure`` with the Python exception its rank printed, once all its output was read.

    Only a plain exit with Python's uncaught-exception status qualifies: a traceback that a worker
    printed and handled before exiting with a status of its own (or before a signal killed it)
    is not why it ended.
    """
    if failure.detail is not None or failure.returncode != _UNCAUGHT_EXCEPTION_STATUS:
        return failure
    reason = router.last_exception(failure.rank)
    return replace(failure, reason=reason) if reason else failure
