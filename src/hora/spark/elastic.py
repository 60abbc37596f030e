"""``hora.spark.run_elastic``: an elastic hora job whose slots are long-running Spark tasks.

horovod.spark's ``run_elastic``. The same :class:`~hora.runner.elastic.driver.ElasticDriver` as
``hora run --min-np`` supervises the job; what is Spark's is how slots appear and workers start
(:mod:`hora.spark.elastic_agent` is the task side):

- the driver runs one ordinary Spark job of ``max_np`` agent tasks in the background; Spark starts
  as many as it has slots for, and starts failed ones again elsewhere;
- :class:`SparkAgentDiscovery`: the hosts are the executors of the agents whose heartbeat is fresh
  (``AGENT_LOST_S``), one slot per agent;
- :class:`SparkAgentLauncher`: starting a worker for a slot hands an idle agent of that executor the
  slot's environment; the worker's end is the outcome the agent posts, or the agent falling silent
  (its executor was lost), which counts as the worker being lost.

An executor whose worker failed gets a cooldown before it is used again (``cooldown_range``,
default :data:`~hora.runner.elastic.hosts.CLUSTER_COOLDOWN_RANGE`); a lost executor's replacement
is a new host, used at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

import cloudpickle

from hora import config
from hora.errors import ConfigError, LaunchError
from hora.rendezvous import KeyValueStore, RendezvousServer, new_secret
from hora.runner.api import raise_remote
from hora.runner.elastic.discovery import HostSlots
from hora.runner.elastic.driver import ElasticDriver, ElasticOutcome, ElasticSettings
from hora.runner.elastic.hosts import CLUSTER_COOLDOWN_RANGE
from hora.runner.launching.launch import WorkerExit
from hora.runner.launching.worker_env import JobContext, worker_environment
from hora.spark import elastic_agent as agents
from hora.spark.runner import OutputRelay, _active_context, _pickled, task_slots
from hora.workers.hosts import SlotInfo

logger = logging.getLogger(__name__)

# An agent whose heartbeat is older than this counts as lost (its executor died or hangs).
AGENT_LOST_S = 5.0
RAISED = 1
LOST = 137
_POLL_S = 0.1
_AGENTS_END_S = 15.0


class SparkAgentDiscovery:
    """Executors with live agents, one slot per agent, in the order they first registered."""

    static = False

    def __init__(self, store: KeyValueStore) -> None:
        self.store = store
        self._order: list[str] = []

    def agents(self) -> dict[str, str]:
        """Live agents and their machine: registered, heartbeat fresh."""
        now = time.time()
        alive: dict[str, str] = {}
        prefix = f"{agents.PREFIX}agents/"
        for key in sorted(self.store.keys(prefix)):
            agent = key[len(prefix):]
            beat = self.store.try_get(agents.heartbeat_key(agent))
            info = self.store.try_get(key)
            if beat is None or info is None or now - float(beat.decode()) > AGENT_LOST_S:
                continue
            alive[agent] = json.loads(info)["host"]
        return alive

    def find(self) -> HostSlots:
        counts: dict[str, int] = {}
        for host in self.agents().values():
            counts[host] = counts.get(host, 0) + 1
            if host not in self._order:
                self._order.append(host)
        return {host: counts[host] for host in self._order if host in counts}


class SparkAgentProcess:
    """A worker running in an agent, as the elastic driver sees it."""

    def __init__(self, launcher: SparkAgentLauncher, agent: str, number: int, slot: SlotInfo) -> None:
        self.launcher = launcher
        self.agent = agent
        self.number = number
        self.host = slot.hostname
        self.first_rank = slot.rank
        self.rank: int | None = None
        self.left = False
        self.result: Any = None
        self.succeeded = False
        self.error_blob: tuple | None = None  # ("error", exc blob, text, traceback)
        self._done = threading.Event()
        self._stopped = False

    def describe(self) -> str:
        return f"Spark agent {self.agent} on {self.host}"

    def wait(self) -> tuple[int, str | None]:
        try:
            return self._wait()
        except Exception as exc:  # the driver must hear of every end
            logger.debug("hora.spark: waiting for worker %d failed", self.number, exc_info=True)
            return RAISED, f"could not be followed: {type(exc).__name__}: {exc}"
        finally:
            self._done.set()
            self.launcher.release(self.agent)

    def _wait(self) -> tuple[int, str | None]:
        store = self.launcher.store
        key = agents.outcome_key(self.agent, self.number)
        while True:
            blob = store.try_get(key)
            if blob is not None:
                return self._read(cloudpickle.loads(blob))
            if self._stopped:
                return LOST, "stopped by the driver"
            beat = store.try_get(agents.heartbeat_key(self.agent))
            if beat is None or time.time() - float(beat.decode()) > AGENT_LOST_S:
                return LOST, f"was lost: its Spark task fell silent for {AGENT_LOST_S:g} s (executor lost?)"
            time.sleep(_POLL_S)

    def _read(self, posted: dict[str, Any]) -> tuple[int, str | None]:
        self.rank = posted.get("rank")
        if posted.get("left"):
            self.left = True
            return 0, None
        decoded = cloudpickle.loads(posted["outcome"])
        if decoded[0] == "ok":
            self.result, self.succeeded = decoded[1], True
            return 0, None
        self.error_blob = decoded
        return RAISED, f"raised {decoded[2]}"

    def terminate(self) -> None:
        # A function running in a Spark task cannot be stopped from here; the worker leaves by itself
        # (its collectives fail, and the next round has no slot for it). The agent stays busy until then.
        self._stopped = True

    def kill(self) -> None:
        self.terminate()

    def alive(self) -> bool:
        return not self._done.is_set()


class SparkAgentLauncher:
    """Hands workers to idle agents (a :class:`~hora.runner.elastic.driver.WorkerLauncher`)."""

    def __init__(self, server: RendezvousServer, context: JobContext, discovery: SparkAgentDiscovery,
                 extra_env: Mapping[str, str]) -> None:
        self.server = server
        self.context = context
        self.discovery = discovery
        self.extra_env = dict(extra_env)
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self.workers: list[SparkAgentProcess] = []

    @property
    def store(self) -> KeyValueStore:
        return self.server.store

    @property
    def kill_grace(self) -> float:
        return float(config.get("kill_grace"))

    def start(self, slot: SlotInfo, env: Mapping[str, str], number: int) -> SparkAgentProcess:
        with self._lock:
            idle = [agent for agent, host in self.discovery.agents().items()
                    if host == slot.hostname and agent not in self._busy]
            if not idle:
                raise LaunchError(f"no idle Spark agent on {slot.hostname} for rank {slot.rank}")
            agent = idle[0]
            self._busy.add(agent)
        full = worker_environment(slot, self.context, base={}, extra={**self.extra_env, **env})
        self.store.set(agents.command_key(agent, number), json.dumps(full).encode())
        process = SparkAgentProcess(self, agent, number, slot)
        self.workers.append(process)
        return process

    def release(self, agent: str) -> None:
        """The agent's worker ended: it may take another (if it still lives)."""
        with self._lock:
            self._busy.discard(agent)

    def drain_output(self, timeout: float) -> bool:
        return True  # the relay thread of run_elastic writes it

    def explain(self, failure: WorkerExit, number: int) -> WorkerExit:
        return failure


def _same(name: str, value: int | None, alias: str, alias_value: int | None) -> int | None:
    if value is not None and alias_value is not None and value != alias_value:
        raise ConfigError(f"hora.spark.run_elastic: give {name} or {alias}, not both "
                          f"({name}={value}, {alias}={alias_value})")
    return value if value is not None else alias_value


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: Mapping[str, str] | None = None,
                stdout: TextIO | None = None, stderr: TextIO | None = None, verbose: int = 1,
                nics: Sequence[str] | None = None, prefix_output_with_timestamp: bool = False,
                min_np: int | None = None, max_np: int | None = None,
                cooldown_range: Sequence[float] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic hora job on Spark tasks; each rank's result of the
    final world, in rank order.

    ``num_proc`` workers to start with (default: the cluster's task slots), between ``min_num_proc``
    (default ``num_proc``) and ``max_num_proc`` (default ``num_proc``); ``min_np``/``max_np`` are the
    older spellings. ``fn`` is written for elastic training (``hvd.elastic.run`` around the loop). A
    lost executor's workers are lost and the world re-forms without them; Spark's new attempts of
    their tasks join again. ``start_timeout`` bounds each worker's wait for its peers,
    ``elastic_timeout`` (default 600 s) the wait for ``min_num_proc`` workers or for a round to form,
    ``reset_limit`` how often the world may re-form. ``verbose=0`` keeps the driver's per-round
    lines (logged at INFO) out, leaving its warnings. When the job cannot go on, the call raises
    :class:`hora.errors.LaunchError` naming the bound, with the last exception a worker raised as its
    cause; a worker that raises after training finished on another fails the call with that exception.
    """
    where = "hora.spark.run_elastic"
    sc = _active_context()
    slots = task_slots(sc)
    start = slots if num_proc is None else num_proc
    low = _same("min_num_proc", min_num_proc, "min_np", min_np)
    high = _same("max_num_proc", max_num_proc, "max_np", max_np)
    low = start if low is None else low
    high = max(start, low) if high is None else high
    for name, value in (("num_proc", start), ("min_num_proc", low), ("max_num_proc", high)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
    settings = ElasticSettings(min_np=low, max_np=high, np=start,
                               elastic_timeout=600.0 if elastic_timeout is None else float(elastic_timeout),
                               reset_limit=reset_limit,
                               cooldown_range=(CLUSTER_COOLDOWN_RANGE if cooldown_range is None
                                               else (float(cooldown_range[0]), float(cooldown_range[1]))),
                               removal_grace=float(config.get("elastic_removal_grace")))
    payload = _pickled(fn, args, kwargs)
    timeout = float(config.get("start_timeout")) if start_timeout is None else float(start_timeout)
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    if isinstance(nics, str):
        nics = nics.split(",")
    nic_tuple = tuple(str(n).strip() for n in nics or () if str(n).strip()) or None
    host = sc.getConf().get("spark.driver.host", None) or "127.0.0.1"
    secret = new_secret()
    server = RendezvousServer(secret, host=host, port=0).start()
    context = JobContext.fresh(*server.address, secret=secret)
    job = _AgentJob(sc, context, high, nic_tuple)
    relay = OutputRelay(stdout, stderr, prefix_output_with_timestamp)
    stop_relay = threading.Event()

    def relay_loop() -> None:
        while not stop_relay.wait(0.2):
            relay.deliver(server.store)

    relay_thread = threading.Thread(target=relay_loop, name="hora-spark-output", daemon=True)
    try:
        server.store.set(agents.FUNC_KEY, payload)
        server.store.set(agents.SYS_PATH_KEY, json.dumps([p for p in sys.path if isinstance(p, str)]).encode())
        discovery = SparkAgentDiscovery(server.store)
        launcher = SparkAgentLauncher(server, context, discovery, extra)
        relay_thread.start()
        job.start()
        # Workers wait for their peers at least as long as the driver waits for a round to form.
        env_timeout = max(timeout, settings.elastic_timeout)
        launcher.extra_env.update(config.env_for("start_timeout", env_timeout))
        with _quiet_driver(verbose < 1):
            outcome = ElasticDriver(launcher, discovery, settings).run()
    finally:
        server.store.set(agents.END_KEY, b"1")
        job.stop()
        stop_relay.set()
        relay_thread.join(timeout=5)
        relay.deliver(server.store)
        relay.flush()
        server.stop()
    if job.error is not None and not outcome.rounds:
        raise LaunchError(f"{where}: the Spark job of agents failed: {job.error}")
    return _results(where, outcome, launcher)


@contextlib.contextmanager
def _quiet_driver(quiet: bool) -> Iterator[None]:
    """``verbose=0``: the driver's per-round lines (INFO) are left out for this call, its warnings
    kept; otherwise the logging configuration decides, as for ``hora run``."""
    driver_logger = logging.getLogger("hora.runner.elastic.driver")
    saved = driver_logger.level
    if quiet:
        driver_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        driver_logger.setLevel(saved)


class _AgentJob:
    """The background Spark job whose tasks are the agents."""

    def __init__(self, sc: Any, context: JobContext, count: int, nics: tuple[str, ...] | None) -> None:
        self.sc = sc
        self.context = context
        self.count = count
        self.nics = nics
        self.group = f"hora-elastic-{context.job_id}"
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="hora-spark-agents", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        context, nics = self.context, self.nics
        try:
            self.sc.setJobGroup(self.group, f"hora elastic job: {self.count} agent tasks", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.count), self.count)
            rdd.mapPartitions(lambda it: agents.serve(context, nics, it)).collect()
        except BaseException as exc:  # reported by the caller if it matters
            from hora.spark.runner import _spark_reason

            self.error = _spark_reason(exc)

    def stop(self) -> None:
        """Agents end at the end key; those that do not (a function still running) are cancelled."""
        self._thread.join(timeout=_AGENTS_END_S)
        if self._thread.is_alive():
            try:
                self.sc.cancelJobGroup(self.group)
            except Exception as exc:  # the context may be stopping
                logger.debug("cancelling the agents' Spark job: %s", exc)
            self._thread.join(timeout=_AGENTS_END_S)


def _results(where: str, outcome: ElasticOutcome, launcher: SparkAgentLauncher) -> list[Any]:
    """The final world's results in rank order, or the exception standing for the failure."""
    by_number = {worker.number: worker for worker in launcher.workers}
    if outcome.succeeded:
        return outcome.final_results(
            {w.number: (w.rank if w.rank is not None else w.first_rank, w.result)
             for w in launcher.workers if w.succeeded}, where)
    failed = by_number.get(outcome.failure_worker) if outcome.failure_worker is not None else None
    if failed is not None and failed.error_blob is not None:
        _raise_worker_error(failed, outcome.size)  # the job was finishing when this worker raised
    error = LaunchError(f"{where}: {outcome.message()}")
    for number in reversed(outcome.failure_workers):  # the last failure that was an exception
        worker = by_number.get(number)
        if worker is not None and worker.error_blob is not None:
            try:
                _raise_worker_error(worker, outcome.size)
            except BaseException as cause:  # attached as the cause
                error.__cause__ = cause
            break
    raise error


def _raise_worker_error(worker: SparkAgentProcess, size: int) -> None:
    assert worker.error_blob is not None
    rank = worker.rank if worker.rank is not None else worker.first_rank
    raise_remote(rank, worker.host, size, *worker.error_blob[1:])
