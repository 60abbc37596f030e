"""Elastic hora jobs on Ray: the elastic driver of ``hora run --min-np/--max-np``, with Ray actors as workers.

:class:`ElasticRayExecutor` (horovod.ray's) and ``RayExecutor(min_workers=..., max_workers=...)``
both run one :class:`ElasticRayJob` per ``run`` call. The job hands three things to the same
:class:`~hora.runner.elastic.driver.ElasticDriver` that supervises process jobs, so blacklisting,
cooldown, rounds, announcements and every bound behave exactly as documented in docs/elastic.md:

- :class:`RayHostDiscovery`: the hosts are Ray's live nodes. A node's slots are the workers its free
  CPUs (and GPUs, with ``use_gpu``) can hold, counting what this job's own workers hold there as
  free for the job. Ray's per-node view of free resources trails actor starts and ends by up to a
  second (measured: a node still showed a started actor's CPU as free), so a node's slot count
  changes only when two polls in a row agree; a node that joins or dies changes the answer at once.
- :class:`RayActorLauncher`: a worker is a :class:`~hora.ray.worker.RayWorker` actor pinned to its
  node (``NodeAffinitySchedulingStrategy``, hard), configured with its slot's environment plus
  ``HORA_HOST_ID`` (the node id, so shared memory is used inside a node and TCP across), running the
  user's function. The driver serves the rendezvous store with a fresh secret.
- :class:`RayActorProcess`: what the driver waits on. Its exit status is 0 when the function
  returned (or the worker left a world that no longer has a place for it), 1 when it raised, and
  the actor's loss otherwise; an actor Ray does not start within ``timeout_s`` counts as failed.

Unlike ``hora run`` (and Horovod), a blacklisted Ray node gets another chance by default: Ray
removes dead nodes from the cluster itself, so a live node whose worker died (killed, out of memory,
preempted process) is tried again after a cooldown (``DEFAULT_COOLDOWN_RANGE``, then doubling).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle
import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hora import config
from hora.errors import ConfigError, LaunchError
from hora.ray import ray_logger
from hora.ray.failures import first_line, lost_reason, remote_exception
from hora.ray.placement import WorkerResources
from hora.ray.worker import Call, RayWorker
from hora.rendezvous import KeyValueStore, RendezvousServer, new_secret
from hora.runner.elastic.discovery import DiscoveryError, HostSlots
from hora.runner.elastic.driver import ElasticDriver, ElasticOutcome, ElasticSettings
from hora.runner.elastic.hosts import CLUSTER_COOLDOWN_RANGE
from hora.runner.launching.launch import WorkerExit
from hora.runner.launching.worker_env import JobContext, worker_environment
from hora.workers.hosts import SlotInfo

logger = logging.getLogger(__name__)

# Seconds a blacklisted node stays out after its first failure, and at most (see the module doc).
DEFAULT_COOLDOWN_RANGE = CLUSTER_COOLDOWN_RANGE
# Exit statuses a Ray worker reports to the driver.
RAISED = 1
LOST = 137  # as a process killed by SIGKILL would report: the worker did not end by itself
_ANSWER_POLL_S = 0.5
_ACTORS_GONE_S = 10.0
_RELAY_JOIN_S = 30.0


@dataclasses.dataclass(frozen=True)
class RayNode:
    """One live Ray node as discovery saw it."""

    node_id: str
    ip: str
    hostname: str

    @property
    def label(self) -> str:
        """The host name the elastic driver knows the node by: its address and node id, stable for
        the node's life and unique even where several Ray nodes share an address (test clusters)."""
        return f"{self.ip}-{self.node_id[:8]}"


def _free_resources_per_node() -> dict[str, dict[str, float]] | None:
    """Ray's per-node free resources (a private API, stable since Ray 2.0); None where it is missing."""
    try:
        from ray._private.state import state

        return state.available_resources_per_node()
    except Exception as exc:  # an older or newer Ray: fall back to node totals
        logger.debug("hora.ray: per-node free resources are not available (%s); using node totals", exc)
        return None


class RayHostDiscovery:
    """Live Ray nodes and the workers each can take now (see the module doc)."""

    static = False

    def __init__(self, resources: WorkerResources, held: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.resources = resources
        # Workers per node this job runs now (its launcher's ``held``; set once the launcher exists).
        self.held: Callable[[], Mapping[str, int]] = held or (lambda: {})
        self._nodes: dict[str, RayNode] = {}  # label -> node, every node ever seen
        self._order: list[str] = []  # labels in the order first seen: a stable host order
        self._reported: dict[str, int] = {}
        self._candidate: dict[str, int] = {}

    def node_for(self, host: str) -> RayNode | None:
        """The Ray node behind a host name: a label this discovery gave, else a node address or
        host name (hosts named by a discovery of the user's, ``override_discovery=False``)."""
        if host in self._nodes:
            return self._nodes[host]
        entries = [entry for entry in ray.nodes() if entry.get("Alive")]
        for entry in entries:
            if host == _node_of(entry).label:
                return _node_of(entry)
        # Several Ray nodes may share an address (a test cluster on one machine): the first that
        # can hold a worker at all.
        for entry in entries:
            node = _node_of(entry)
            if host in (node.ip, node.hostname) and self._slots(entry.get("Resources", {}),
                                                                 entry.get("Resources", {}), 0) > 0:
                return node
        return None

    def _slots(self, total: Mapping[str, float], free: Mapping[str, float], held_workers: int) -> int:
        slots = []
        for name, per_worker in (("CPU", self.resources.cpus), ("GPU", self.resources.gpus)):
            if per_worker <= 0:
                continue
            available = min(free.get(name, 0.0) + held_workers * per_worker, total.get(name, 0.0))
            slots.append(int(math.floor(available / per_worker + 1e-9)))
        return min(slots) if slots else 0

    def find(self) -> HostSlots:
        try:
            entries = [entry for entry in ray.nodes() if entry.get("Alive")]
        except Exception as exc:  # the cluster state could not be read this time
            raise DiscoveryError(f"reading Ray's node table failed: {exc}") from exc
        free = _free_resources_per_node()
        held = self.held()
        now: dict[str, int] = {}
        for entry in entries:
            node = _node_of(entry)
            if node.label not in self._nodes:
                self._nodes[node.label] = node
                self._order.append(node.label)
            total = entry.get("Resources", {})
            measured = self._slots(total, free.get(node.node_id, {}) if free is not None else total,
                                   held.get(node.node_id, 0) if free is not None else 0)
            previous = self._reported.get(node.label)
            if previous is None or measured == previous or self._candidate.get(node.label) == measured:
                self._reported[node.label] = measured  # new node, steady, or confirmed by a second poll
                self._candidate.pop(node.label, None)
            else:
                self._candidate[node.label] = measured
            now[node.label] = self._reported[node.label]
        for label in list(self._reported):
            if label not in now:  # a node that died: gone at once
                self._reported.pop(label)
                self._candidate.pop(label, None)
        return {label: now[label] for label in self._order if now.get(label, 0) > 0}


def _node_of(entry: Mapping[str, Any]) -> RayNode:
    return RayNode(str(entry["NodeID"]), str(entry.get("NodeManagerAddress", "")),
                   str(entry.get("NodeManagerHostname", "")))


@dataclasses.dataclass
class WorkerResult:
    """What a worker's function gave back: its rank in the last world it joined and the value."""

    rank: int | None
    value: Any


class RayActorProcess:
    """One worker actor as the elastic driver sees it (a :class:`~hora.runner.elastic.driver.WorkerProcess`)."""

    def __init__(self, launcher: RayActorLauncher, actor: Any, number: int, slot: SlotInfo, node: RayNode) -> None:
        self.launcher = launcher
        self.actor = actor
        self.number = number
        self.node = node
        self.first_rank = slot.rank
        self.pid: int | None = None
        self.ready = False  # the actor runs on its node (it holds its resources there)
        self.result: WorkerResult | None = None
        self.left = False  # it ended because the world no longer had a place for it
        self.error: BaseException | None = None  # what the function raised, with its remote traceback
        self._done = threading.Event()
        self._stopped = False

    def describe(self) -> str:
        pid = f", pid {self.pid}" if self.pid is not None else ""
        return f"Ray actor on node {self.node.node_id[:12]} at {self.node.ip}{pid}"

    def wait(self) -> tuple[int, str | None]:
        try:
            return self._run()
        except Exception as exc:  # the driver must hear of every end, however it came
            logger.debug("hora.ray: worker %d failed in the driver", self.number, exc_info=True)
            return RAISED, f"could not be run: {type(exc).__name__}: {first_line(exc)}"
        finally:
            self._done.set()

    def _run(self) -> tuple[int, str | None]:
        timeout = self.launcher.timeout_s
        where = self._answer(self.actor.where.remote(), timeout)
        if isinstance(where, tuple):
            if where[1] is None:
                return LOST, (f"Ray did not start the worker on node {self.node.node_id[:12]} within timeout_s="
                              f"{timeout:g} s (it needs {self.launcher.describe_resources()} there)")
            return where
        self.pid = where["pid"]
        self.ready = True
        configured = self._answer(self.actor.configure.remote(self.first_rank, self.launcher.env_for(self),
                                                              self.launcher.nics), timeout)
        if isinstance(configured, tuple):
            return configured if configured[1] is not None else (LOST, "configuring the worker timed out")
        outcome = self._answer(self.actor.run_elastic.remote(self.launcher.call, self.launcher.call_id), None)
        if isinstance(outcome, tuple):
            return outcome
        if outcome.get("left"):
            self.left = True
            return 0, None
        self.result = WorkerResult(outcome.get("rank"), outcome.get("value"))
        return 0, None

    def _answer(self, ref: Any, timeout: float | None) -> Any:
        """The call's value, or (status, reason) when it failed, or (LOST, None) when it timed out."""
        began = time.monotonic()
        while True:
            ready, _ = ray.wait([ref], timeout=_ANSWER_POLL_S)
            if ready:
                break
            if self._stopped:
                return LOST, "stopped by the driver"
            if timeout is not None and time.monotonic() - began > timeout:
                self.launcher.kill(self.actor)
                return LOST, None
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            rank = getattr(exc.cause, "hora_rank", None)
            rank = self.first_rank if not isinstance(rank, int) else rank
            self.error = remote_exception(exc, rank, f"Ray node {self.node.node_id[:12]} at {self.node.ip}", None)
            return RAISED, f"raised {type(self.error).__name__}: {first_line(self.error)}"
        except ray.exceptions.RayError as exc:  # the actor died, or its node did
            if self._stopped:
                return LOST, "stopped by the driver"
            return LOST, f"was lost: {lost_reason(exc)}"

    def terminate(self) -> None:
        self._stopped = True
        self.launcher.kill(self.actor)

    def kill(self) -> None:
        self.terminate()

    def alive(self) -> bool:
        return not self._done.is_set()


class RayActorLauncher:
    """Starts a job's workers as Ray actors (a :class:`~hora.runner.elastic.driver.WorkerLauncher`)."""

    def __init__(self, discovery: RayHostDiscovery, call: Call, resources: WorkerResources, timeout_s: float,
                 nics: Sequence[str] | None = None, extra_env: Mapping[str, str] | None = None,
                 call_id: str | None = None) -> None:
        self.discovery = discovery
        self.call = call
        self.call_id = call_id
        self.resources = resources
        self.timeout_s = float(timeout_s)
        self.nics = list(nics) if nics else None
        self._extra_env = {str(key): str(value) for key, value in (extra_env or {}).items()}
        self._server: RendezvousServer | None = None
        self._context: JobContext | None = None
        self._actor_cls = ray.remote(RayWorker)
        self._sys_path = [entry for entry in sys.path if isinstance(entry, str)]
        self._lock = threading.Lock()
        self.workers: list[RayActorProcess] = []
        self._envs: dict[int, dict[str, str]] = {}

    # ---- the job's store -------------------------------------------------------------------------

    def open(self) -> None:
        secret = new_secret()  # fresh per run: an actor of another job cannot join this one
        self._server = RendezvousServer(secret, host=ray.util.get_node_ip_address(), port=0).start()
        self._context = JobContext.fresh(*self._server.address, secret=secret)

    def close(self) -> None:
        """Kill every actor this job started (finished ones hold their resources until then) and
        stop the store."""
        with self._lock:
            workers = list(self.workers)
        for worker in workers:
            self.kill(worker.actor)
        # ray.kill returns before the actor is gone; wait (bounded) until each is, so a run that
        # follows finds their resources free again.
        pings = []
        for worker in workers:
            try:
                pings.append(worker.actor.where.remote())
            except Exception as exc:  # Ray may already be shutting down
                logger.debug("hora.ray: pinging a killed worker: %s", exc)
        if pings:
            ray.wait(pings, num_returns=len(pings), timeout=_ACTORS_GONE_S)
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    @property
    def server(self) -> RendezvousServer:
        if self._server is None:
            raise RuntimeError("the Ray job's rendezvous store is not running")
        return self._server

    @property
    def store(self) -> KeyValueStore:
        return self.server.store

    @property
    def kill_grace(self) -> float:
        return float(config.get("kill_grace"))

    # ---- workers ---------------------------------------------------------------------------------

    def start(self, slot: SlotInfo, env: Mapping[str, str], number: int) -> RayActorProcess:
        try:
            node = self.discovery.node_for(slot.hostname)
            if node is None:
                raise LaunchError(f"no live Ray node is known as {slot.hostname}")
            actor = self._actor_cls.options(
                num_cpus=self.resources.cpus, num_gpus=self.resources.gpus, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            ).remote(self._sys_path)
        except LaunchError:
            raise
        except Exception as exc:  # one host's trouble, not the job's end
            raise LaunchError(f"Ray could not start a worker on {slot.hostname}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from exc
        assert self._context is not None
        full = worker_environment(slot, self._context, base={}, extra={**self._extra_env, **env})
        full.update(config.env_for("host_id", node.node_id, with_alias=False))
        process = RayActorProcess(self, actor, number, slot, node)
        with self._lock:
            self.workers.append(process)
            self._envs[number] = full
        return process

    def env_for(self, process: RayActorProcess) -> dict[str, str]:
        return self._envs[process.number]

    def held(self) -> dict[str, int]:
        """Workers per node started and not yet ended (for discovery's free-slot count). Ray takes an
        actor's resources when it places it, well before the actor answers, so a worker counts from
        its start: counting it only once it answered would show its node short of a slot meanwhile."""
        counts: dict[str, int] = {}
        with self._lock:
            for worker in self.workers:
                if worker.alive():
                    counts[worker.node.node_id] = counts.get(worker.node.node_id, 0) + 1
        return counts

    def kill(self, actor: Any) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # already dead, or Ray is shutting down
            logger.debug("hora.ray: killing a worker: %s", exc)

    def describe_resources(self) -> str:
        return ", ".join(f"{name} {amount:g}" for name, amount in self.resources.bundle().items())

    def drain_output(self, timeout: float) -> bool:
        return True  # Ray forwards the actors' output itself

    def explain(self, failure: WorkerExit, number: int) -> WorkerExit:
        return failure  # the reason came back with the exception


@dataclasses.dataclass(frozen=True)
class ElasticRayOptions:
    """Everything one elastic Ray job needs besides the function."""

    min_np: int
    max_np: int | None
    np: int | None
    resources: WorkerResources
    timeout_s: float = 30.0
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = DEFAULT_COOLDOWN_RANGE
    nics: tuple[str, ...] | None = None
    env: tuple[tuple[str, str], ...] = ()
    discovery: Any = None  # a user's discovery (override_discovery=False), else Ray's nodes

    def settings(self) -> ElasticSettings:
        start = self.np if self.np is not None else self.min_np
        return ElasticSettings(min_np=self.min_np, max_np=self.max_np, np=start,
                               elastic_timeout=self.elastic_timeout, reset_limit=self.reset_limit,
                               cooldown_range=self.cooldown_range,
                               removal_grace=float(config.get("elastic_removal_grace")))


class _UserDiscovery:
    """A discovery object of the user's (Horovod's ``HostDiscovery`` with
    ``find_available_hosts_and_slots()``, or a function returning ``{host: slots}``), whose host
    names are Ray node addresses or host names."""

    static = False

    def __init__(self, source: Any) -> None:
        self._find = getattr(source, "find_available_hosts_and_slots", None) or source
        if not callable(self._find):
            raise ConfigError("hora.ray: settings.discovery must have find_available_hosts_and_slots() or be "
                              f"a function returning {{host: slots}}, got {type(source).__name__}")

    def find(self) -> HostSlots:
        try:
            found = self._find()
        except Exception as exc:  # one failed poll; the driver keeps the last answer
            raise DiscoveryError(f"the discovery raised {type(exc).__name__}: {exc}") from exc
        try:
            return {str(host): int(slots) for host, slots in dict(found).items() if int(slots) > 0}
        except (TypeError, ValueError) as exc:
            raise DiscoveryError(f"the discovery returned {found!r}, not {{host: slots}}") from exc


def run_elastic_job(options: ElasticRayOptions, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                    kwargs: Mapping[str, Any] | None = None,
                    callbacks: Sequence[Callable[[Any], Any]] | None = None,
                    on_start: Callable[[RayActorLauncher], None] | None = None) -> tuple[list[Any], ElasticOutcome]:
    """Run ``fn`` as one elastic job to its end: each final rank's result in rank order, and the outcome.

    ``on_start(launcher)`` is called once the store is up (the executor keeps the launcher, so its
    ``workers`` can be listed while the job runs).
    """
    import uuid

    call = Call(fn, args, kwargs)
    try:
        cloudpickle.dumps(call)
    except Exception as exc:  # said before any worker starts, not once per worker
        raise ConfigError(f"hora.ray: the function or its arguments cannot be sent to the workers: "
                          f"{type(exc).__name__}: {first_line(exc)}") from exc
    discovery = RayHostDiscovery(options.resources)
    call_id = uuid.uuid4().hex if callbacks else None
    env = dict(options.env)
    launcher = RayActorLauncher(discovery, call, options.resources, options.timeout_s,
                                nics=options.nics, extra_env=env, call_id=call_id)
    discovery.held = launcher.held
    source = discovery if options.discovery is None else _UserDiscovery(options.discovery)
    relay: ray_logger.CallbackRelay | None = None
    stop_relay = threading.Event()
    relay_thread = None
    try:
        launcher.open()
        if callbacks:
            relay = ray_logger.CallbackRelay(launcher.server, call_id, list(callbacks))

            def deliver() -> None:
                while not stop_relay.wait(0.1):
                    relay.deliver()

            relay_thread = threading.Thread(target=deliver, name="hora-ray-callbacks", daemon=True)
            relay_thread.start()
        if on_start is not None:
            on_start(launcher)
        outcome = ElasticDriver(launcher, source, options.settings()).run()
    finally:
        stop_relay.set()
        if relay_thread is not None:
            relay_thread.join(timeout=_RELAY_JOIN_S)
        if relay is not None:
            if relay_thread is not None and relay_thread.is_alive():
                logger.warning("hora.ray: a callback is still running %g s after the job ended; values not "
                               "delivered yet are dropped", _RELAY_JOIN_S)
            else:
                relay.finish()
        launcher.close()
    if relay is not None:
        relay.raise_failure()
    return _results(outcome, launcher), outcome


def _results(outcome: ElasticOutcome, launcher: RayActorLauncher) -> list[Any]:
    """The final world's results in rank order, or the exception standing for the job's failure."""
    by_number = {worker.number: worker for worker in launcher.workers}
    if outcome.succeeded:
        return outcome.final_results(
            {w.number: (w.result.rank if w.result.rank is not None else w.first_rank, w.result.value)
             for w in launcher.workers if w.result is not None}, "hora.ray")
    failed = by_number.get(outcome.failure_worker) if outcome.failure_worker is not None else None
    if failed is not None and failed.error is not None:
        # The job was finishing when this worker raised: its exception is the job's failure.
        raise failed.error
    error = LaunchError(f"hora.ray: {outcome.message()}")
    for number in reversed(outcome.failure_workers):  # the last failure that was an exception
        worker = by_number.get(number)
        if worker is not None and worker.error is not None:
            error.__cause__ = worker.error
            break
    raise error
