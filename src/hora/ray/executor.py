"""``hora.ray.RayExecutor``: a fixed-size hora job whose workers are Ray actors.

The constructor and methods are horovod.ray's, so a script written for ``horovod.ray`` runs after
changing its import. What ``start()`` does:

1. reserves the workers' resources in a placement group (:mod:`hora.ray.placement`: ``PACK`` for
   ``num_workers``, one bundle per node with ``STRICT_SPREAD`` for ``num_hosts``), within
   ``placement_group_timeout_s``;
2. starts one actor per worker (:class:`hora.ray.worker.RayWorker`) and asks each for its Ray node;
3. groups the actors by Ray node id (not by address: Ray's test clusters run every node on one
   address) and numbers ranks node by node with :func:`hora.workers.hosts.assign_slots`, so local and
   cross ranks follow the real grouping;
4. serves the job's rendezvous store from this process with a fresh secret, on this node's Ray
   address, and gives each actor its rank's environment (:func:`hora.runner.launching.worker_env.worker_environment`)
   plus ``HORA_HOST_ID`` = its Ray node id, so the transport treats each Ray node as one host
   (shared memory inside it, TCP across) even when several share a machine;
5. builds the executable on every worker, if a class was given.

Failures: a worker that raises makes ``run`` raise that exception here (its rank and remote
traceback attached); the other workers get ``timeout_s`` to finish (their collectives fail once the
failed worker leaves the job), after which any still running are stopped. An actor that Ray kills
or loses with its node makes ``run`` raise :class:`hora.errors.HorovodInternalError` naming the rank
and node, and stops the job's workers. Every wait of ``start`` is bounded; ``run`` waits as long as
the workers make progress.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ray
import ray.exceptions

from hora import config
from hora.errors import ConfigError, HoraError, HorovodInternalError, LaunchError
from hora.ray import ray_logger
from hora.ray.elastic import ElasticRayOptions
from hora.ray.elastic_executor import ElasticJobRunner, check_bounds, resolve_cooldown
from hora.ray.failures import first_line, lost_reason, remote_exception, strip_colours
from hora.ray.placement import Placement, WorkerResources, reserve
from hora.ray.worker import Call, RayWorker
from hora.rendezvous import RendezvousServer, new_secret
from hora.runner.launching.worker_env import JobContext, worker_environment
from hora.workers.hosts import Host, SlotInfo, assign_slots

logger = logging.getLogger(__name__)

# How often the driver looks at logged values while a call with callbacks runs, and otherwise how
# long one wait for results lasts before the time-outs are checked again.
CALLBACK_POLL_S = 0.1
RESULT_POLL_S = 1.0


@dataclasses.dataclass
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns (horovod.ray's ``MiniSettings`` fields).

    ``timeout_s`` bounds every wait of ``start()`` and is the workers' ``HORA_START_TIMEOUT`` (how
    long ranks wait for each other to join); after a worker fails, the others get that long to
    finish. ``placement_group_timeout_s`` bounds the wait for Ray to reserve the resources.
    ``nics``: network interface names (or addresses) workers listen on for their peers, the first
    one present on each node. ``ssh_port`` and ``ssh_identity_file`` are kept for horovod.ray
    compatibility: Ray starts every worker, so hora uses no SSH.
    """

    nics: set[str] | None = None
    verbose: int = 1
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: float = 30
    placement_group_timeout_s: float = 100


class RayExecutor:
    """A fixed-size hora job on Ray actors (horovod.ray's ``RayExecutor``).

    ``settings`` from :meth:`create_settings` (None means its defaults; any object with
    ``timeout_s``, ``placement_group_timeout_s`` and ``nics`` attributes will do). Size the job with
    ``num_workers`` (packed onto as few nodes as Ray can), or with ``num_hosts`` and
    ``num_workers_per_host`` (that many workers on each of that many different nodes), not both.
    Each worker reserves ``cpus_per_worker`` CPUs and, with ``use_gpu``, ``gpus_per_worker`` GPUs
    (default 1); the GPUs of a node's workers are all visible to each of them, in local-rank order,
    so ``torch.cuda.set_device(hvd.local_rank())`` picks the worker's own. Inside a placement group
    (a Ray Tune trial) the workers use that group unless ``use_current_placement_group=False``.

    ``min_workers`` and/or ``max_workers`` make the executor elastic (see
    :mod:`hora.ray.elastic_executor`): ``num_workers`` is then how many to start with, and
    ``reset_limit``, ``cooldown_range``, ``elastic_timeout`` and ``override_discovery`` apply (they
    are refused on a fixed-size executor).
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: float = 100,
                        nics: Iterable[str] | None = None) -> RaySettings:
        """The executor's settings (horovod.ray's signature; see :class:`RaySettings`).

        ``ssh_identity_file`` and ``ssh_str`` are accepted and unused: under Ray no worker is
        started over SSH, so no key file is written.
        """
        for name, value in (("timeout_s", timeout_s), ("placement_group_timeout_s", placement_group_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"RayExecutor.create_settings: {name} must be a positive number of "
                                  f"seconds, got {value!r}")
        if ssh_identity_file is not None or ssh_str is not None:
            logger.warning("hora.ray: ssh_identity_file/ssh_str are not used: Ray starts every worker, no SSH")
        if isinstance(nics, str):
            nics = nics.split(",")
        nic_set = {str(name).strip() for name in nics or () if str(name).strip()} or None
        return RaySettings(nics=nic_set, ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                           placement_group_timeout_s=placement_group_timeout_s)

    def __init__(
        self,
        settings: Any,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: Sequence[int] | None = None,
        elastic_timeout: int = 600,
        override_discovery: bool = True,
    ) -> None:
        self.settings = settings if settings is not None else self.create_settings()  # None: the defaults
        self._timeout_s = float(getattr(self.settings, "timeout_s", 30))
        self._pg_timeout_s = float(getattr(self.settings, "placement_group_timeout_s", 100))
        nics = getattr(self.settings, "nics", None)
        self._nics = sorted(nics) if nics else None
        self._elastic: ElasticJobRunner | None = None
        if min_workers is not None or max_workers is not None:
            if num_workers_per_host != 1:
                raise ConfigError(f"RayExecutor: num_workers_per_host={num_workers_per_host} sizes a fixed-size "
                                  "job; an elastic job places its workers by each node's free resources")
            self._elastic = self._elastic_job(num_workers, num_hosts, min_workers, max_workers, cpus_per_worker,
                                              use_gpu, gpus_per_worker, reset_limit, cooldown_range,
                                              elastic_timeout, override_discovery)
        else:
            _only_elastic(reset_limit=reset_limit, cooldown_range=cooldown_range, elastic_timeout=elastic_timeout,
                          override_discovery=override_discovery)
        if num_workers is not None and num_hosts is not None:
            raise ConfigError(f"RayExecutor: give num_workers, or num_hosts with num_workers_per_host, not both "
                              f"(got num_workers={num_workers} and num_hosts={num_hosts})")
        if num_workers is None and num_hosts is None and self._elastic is None:
            raise ConfigError("RayExecutor: give num_workers, or num_hosts with num_workers_per_host (or "
                              "min_workers/max_workers for an elastic job)")
        if num_workers is not None and num_workers_per_host != 1:
            raise ConfigError(f"RayExecutor: num_workers_per_host={num_workers_per_host} applies only with "
                              "num_hosts; with num_workers, Ray packs the workers onto as few nodes as it can")
        _positive_int("num_workers", num_workers)
        _positive_int("num_hosts", num_hosts)
        _positive_int("num_workers_per_host", num_workers_per_host)
        _positive_number("cpus_per_worker", cpus_per_worker)
        if gpus_per_worker is not None and not use_gpu:
            raise ConfigError(f"RayExecutor: gpus_per_worker={gpus_per_worker} needs use_gpu=True")
        if use_gpu:
            _positive_number("gpus_per_worker", 1 if gpus_per_worker is None else gpus_per_worker)
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = (num_workers if num_workers is not None
                            else num_hosts * num_workers_per_host if num_hosts is not None else 0)
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = bool(use_gpu)
        self.gpus_per_worker = (1 if gpus_per_worker is None else gpus_per_worker) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self._workers: list[Any] = []  # actor handles, in rank order
        self._slots: list[SlotInfo] = []
        self._nodes: list[dict[str, Any]] = []  # where() of each rank
        self._placement: Placement | None = None
        self._server: RendezvousServer | None = None
        self.start_seconds: float | None = None

    def _elastic_job(self, num_workers: int | None, num_hosts: int | None, min_workers: int | None,
                     max_workers: int | None, cpus_per_worker: float, use_gpu: bool, gpus_per_worker: float | None,
                     reset_limit: int | None, cooldown_range: Sequence[float] | None, elastic_timeout: float,
                     override_discovery: bool) -> ElasticJobRunner:
        """The elastic form (``min_workers``/``max_workers``): each ``run`` is an elastic job."""
        owner = "RayExecutor"
        if num_hosts is not None:
            raise ConfigError(f"{owner}: num_hosts={num_hosts} sizes a fixed-size job; an elastic job takes "
                              "min_workers/max_workers (and num_workers to start with) and uses every live node")
        low = 1 if min_workers is None else min_workers
        check_bounds(owner, low, max_workers, num_workers)
        _positive_number("cpus_per_worker", cpus_per_worker)
        if gpus_per_worker is not None and not use_gpu:
            raise ConfigError(f"{owner}: gpus_per_worker={gpus_per_worker} needs use_gpu=True")
        gpus = (1 if gpus_per_worker is None else gpus_per_worker) if use_gpu else 0
        if use_gpu:
            _positive_number("gpus_per_worker", gpus)
        if isinstance(elastic_timeout, bool) or not isinstance(elastic_timeout, (int, float)) or elastic_timeout <= 0:
            raise ConfigError(f"{owner}: elastic_timeout must be a positive number of seconds, got {elastic_timeout!r}")
        if reset_limit is not None and (isinstance(reset_limit, bool) or not isinstance(reset_limit, int)
                                        or reset_limit < 0):
            raise ConfigError(f"{owner}: reset_limit must be a non-negative integer, got {reset_limit!r}")
        discovery = None
        if not override_discovery:
            discovery = getattr(self.settings, "discovery", None)
            if discovery is None:
                raise ConfigError(f"{owner}: override_discovery=False needs settings.discovery (the hosts source "
                                  "to use instead of Ray's node table)")
        cooldown = resolve_cooldown(owner, cooldown_range)
        options = ElasticRayOptions(
            min_np=low, max_np=max_workers, np=num_workers,
            resources=WorkerResources(float(cpus_per_worker), float(gpus)), timeout_s=self._timeout_s,
            elastic_timeout=float(elastic_timeout), reset_limit=reset_limit,
            cooldown_range=cooldown,
            nics=tuple(self._nics) if self._nics else None, discovery=discovery)
        return ElasticJobRunner(owner, options)

    @property
    def elastic(self) -> bool:
        """Whether this executor runs elastic jobs (built with min_workers/max_workers)."""
        return self._elastic is not None

    @property
    def last_outcome(self) -> Any:
        """An elastic executor's last ``run``: its rounds, resets, failures and recovery times (else None)."""
        return self._elastic.last_outcome if self._elastic is not None else None

    # ---- starting and stopping ----------------------------------------------------------------

    def start(self, executable_cls: type | None = None, executable_args: Sequence[Any] | None = None,
              executable_kwargs: Mapping[str, Any] | None = None,
              extra_env_vars: Mapping[str, str] | None = None) -> None:
        """Start the workers, form their ranks, and build ``executable_cls(*executable_args,
        **executable_kwargs)`` on each (what ``execute`` passes to its functions).

        ``extra_env_vars`` are set in every worker before the executable is built (hora's own
        identity variables win over them).
        """
        if self._elastic is not None:
            if executable_cls is not None:
                raise ConfigError("RayExecutor.start: executable_cls applies to fixed-size jobs (execute() calls "
                                  "it); an elastic job's workers come and go, so run() a function instead")
            if extra_env_vars:
                self._elastic.options = dataclasses.replace(
                    self._elastic.options, env=tuple((str(k), str(v)) for k, v in extra_env_vars.items()))
            self._elastic.start()
            return
        if self._workers:
            raise HoraError("RayExecutor.start: already started; call shutdown() first")
        began = time.perf_counter()
        self._nodes, self._slots = [], []
        if not ray.is_initialized():
            ray.init()  # as Ray's own first remote call would
        if ray.util.client.ray.is_connected():
            raise LaunchError("hora.ray needs a driver that runs on a node of the Ray cluster (workers "
                              "connect to the rendezvous store it serves); Ray Client (ray://) is not supported")
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
        except BaseException:
            self._tear_down()
            raise
        self.start_seconds = time.perf_counter() - began
        logger.info("hora.ray: %d workers on %d node(s) started in %.1f s", self.num_workers,
                    len({node["node_id"] for node in self._nodes}), self.start_seconds)

    def _start(self, executable_cls: type | None, executable_args: Sequence[Any] | None,
               executable_kwargs: Mapping[str, Any] | None, extra_env_vars: Mapping[str, str] | None) -> None:
        resources = WorkerResources(float(self.cpus_per_worker), float(self.gpus_per_worker))
        self._placement = reserve(self.num_workers, self.num_hosts, self.num_workers_per_host, resources,
                                  self._pg_timeout_s, self.use_current_placement_group)
        actor_cls = ray.remote(RayWorker)
        sys_path = [entry for entry in sys.path if isinstance(entry, str)]
        actors = [
            actor_cls.options(num_cpus=resources.cpus, num_gpus=resources.gpus,
                              scheduling_strategy=self._placement.strategy_for(index)).remote(sys_path)
            for index in range(self.num_workers)
        ]
        self._workers = actors  # creation order until ranks are known; torn down on failure either way
        where = self._bounded_get([actor.where.remote() for actor in actors], "asking the workers where they run")
        order, slots = _rank_layout([info["node_id"] for info in where])
        self._workers = [actors[index] for index in order]
        self._nodes = [where[index] for index in order]
        self._slots = _label_hosts(slots, self._nodes)

        secret = new_secret()  # fresh per start: an actor of another job cannot join this one
        self._server = RendezvousServer(secret, host=ray.util.get_node_ip_address(), port=0).start()
        context = JobContext.fresh(*self._server.address, secret=secret)
        extra = {str(key): str(value) for key, value in (extra_env_vars or {}).items()}
        extra.update(config.env_for("start_timeout", self._timeout_s))
        gpus = _visible_gpus(self._nodes) if self.use_gpu else {}
        configured = []
        for rank, (actor, slot, node) in enumerate(zip(self._workers, self._slots, self._nodes)):
            env = worker_environment(slot, context, base={}, extra=extra)
            env.update(config.env_for("host_id", node["node_id"], with_alias=False))
            if self.use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = gpus[node["node_id"]]
            configured.append(actor.configure.remote(rank, env, self._nics))
        self._bounded_get(configured, "setting the workers' environment")
        self._gather([actor.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                      for actor in self._workers], "building the executable")

    def shutdown(self) -> None:
        """Stop the workers, give back their placement group and stop the rendezvous store.
        Safe to call twice, or after a failed start; ``start()`` may be called again afterwards."""
        if self._elastic is not None:
            self._elastic.shutdown()
            return
        if self._workers:
            try:  # let hora leave cleanly where it can; a busy worker is killed all the same
                ray.wait([actor.stop_hora.remote() for actor in self._workers],
                         num_returns=len(self._workers), timeout=min(5.0, self._timeout_s))
            except Exception as exc:  # the workers are killed next regardless
                logger.debug("hora.ray: stopping hora on the workers: %s", exc)
        self._tear_down()

    def _tear_down(self) -> None:
        workers, self._workers = self._workers, []
        for actor in workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already dead, or Ray is shutting down
                logger.debug("hora.ray: killing a worker: %s", exc)
        placement, self._placement = self._placement, None
        if placement is not None:
            placement.release()
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    # ---- calling functions on the workers -----------------------------------------------------

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: Mapping[str, Any] | None = None,
            callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; each rank's result, in rank order.

        Each of ``callbacks`` is called here with every value a worker sends with
        :func:`hora.ray.ray_logger.log` (rank 0's, by default) while ``fn`` runs.

        An elastic executor runs ``fn`` as one elastic job (see :mod:`hora.ray.elastic_executor`):
        the results are those of the final world's ranks.
        """
        if self._elastic is not None:
            return self._elastic.run(fn, args, kwargs, callbacks)
        return self._call_all(Call(fn, args, kwargs), callbacks, "run")

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every worker; one Ray object ref per rank, in rank order
        (``ray.get`` them; a worker's exception is raised by ``ray.get`` as Ray's ``RayTaskError``)."""
        self._require_started("run_remote")
        call = Call(fn, args, kwargs)
        return [actor.execute.remote(call) for actor in self._workers]

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """``fn(executable)`` on every worker, with the object ``start`` built there (None without
        ``executable_cls``); each rank's result, in rank order."""
        return self._call_all(fn, callbacks, "execute")

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its result."""
        self._require_started("execute_single")
        return self._gather([self._workers[0].execute.remote(fn)], "execute_single")[0]

    @property
    def workers(self) -> list[Any]:
        """The workers' actor handles, in rank order (empty until started); for an elastic executor,
        the workers running now, in start order."""
        if self._elastic is not None:
            return self._elastic.workers
        return list(self._workers)

    def _call_all(self, fn: Callable[[Any], Any], callbacks: Sequence[Callable[[Any], Any]] | None,
                  what: str) -> list[Any]:
        self._require_started(what)
        call_id = uuid.uuid4().hex if callbacks else None
        refs = [actor.execute.remote(fn, call_id) for actor in self._workers]
        relay = ray_logger.CallbackRelay(self._server, call_id, list(callbacks)) if callbacks else None
        return self._gather(refs, what, relay)

    def _require_started(self, what: str) -> None:
        if self._elastic is not None:
            raise HoraError(f"RayExecutor.{what}: not available on an elastic executor (min_workers/max_workers): "
                            "its workers come and go between rounds, so only run() applies")
        if not self._workers:
            raise HoraError(f"RayExecutor.{what}: the executor is not started (call start() first; "
                            "after a lost worker or shutdown(), start() again)")

    def _bounded_get(self, refs: list[Any], what: str) -> list[Any]:
        """Results of a start-up step (``what``) every worker must finish within ``timeout_s``."""
        try:
            return ray.get(refs, timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError:
            late = sum(1 for ref in refs if not ray.wait([ref], timeout=0)[0])
            raise LaunchError(f"hora.ray: {what}: {late} of {len(refs)} workers did not answer within "
                              f"timeout_s={self._timeout_s:g} s (raise it with RayExecutor.create_settings("
                              "timeout_s=...) if they are just slow)") from None
        except ray.exceptions.RayActorError as exc:
            raise LaunchError(f"hora.ray: {what}: a worker died: {strip_colours(str(exc)).strip()}") from exc
        except ray.exceptions.RayTaskError as exc:
            raise LaunchError(f"hora.ray: {what}: a worker failed: {first_line(exc.cause)}\n"
                              f"{strip_colours(str(exc)).rstrip()}") from None

    def _gather(self, refs: list[Any], what: str, relay: ray_logger.CallbackRelay | None = None) -> list[Any]:
        """Every rank's result, in rank order, or the exception standing for the call's failure."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        outcome = _Failures()
        deadline: float | None = None
        while pending:
            poll = CALLBACK_POLL_S if relay is not None else RESULT_POLL_S
            if deadline is not None:
                poll = max(0.0, min(poll, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll)
            if relay is not None:
                relay.deliver()
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    outcome.lost(rank, exc)
                except ray.exceptions.RayTaskError as exc:
                    outcome.raised(rank, exc)
                except ray.exceptions.RayError as exc:  # the result itself was lost with its node
                    outcome.lost(rank, exc)
            if outcome.death is not None:
                break  # the job cannot go on without that rank: stop the rest now
            if outcome.any and deadline is None:
                deadline = time.monotonic() + self._timeout_s
            if deadline is not None and pending and time.monotonic() >= deadline:
                break
        if relay is not None:
            relay.finish()
        if not outcome.any:
            if relay is not None:
                relay.raise_failure()
            return results
        stuck = sorted(pending.values())
        if outcome.death is not None or stuck:
            self._tear_down()
        elif self._workers:
            # Every worker finished, some raised: leave hora shut down everywhere, so the next
            # hora.init() forms the world afresh instead of meeting ranks of the failed one.
            ray.wait([actor.stop_hora.remote() for actor in self._workers], num_returns=len(self._workers),
                     timeout=self._timeout_s)
        raise self._failure(outcome, stuck, what)

    def _failure(self, outcome: _Failures, stuck: list[int], what: str) -> BaseException:
        if outcome.death is not None:
            rank, exc = outcome.death
            lost = HorovodInternalError(f"hora.ray: rank {rank} of {self.num_workers} ({self._where(rank)}) "
                                        f"was lost during {what}: {lost_reason(exc)}; the executor stopped its "
                                        "workers: call start() again")
            lost.__cause__ = exc
            return lost
        stopped = (f"ranks {stuck} were still running {self._timeout_s:g} s (timeout_s) after the first "
                   "failure and were stopped with the other workers: call start() again") if stuck else None
        rank, task_error = outcome.first_raised()
        error = remote_exception(task_error, rank, self._where(rank), stopped)
        peer = getattr(error, "failed_rank", None)  # a PeerFailureError names the peer it lost
        if isinstance(peer, int) and hasattr(error, "add_note"):
            error.add_note(f"rank {peer} ran on {self._where(peer)}")
        return error

    def _where(self, rank: int) -> str:
        """A rank's node, for messages (the last layout is kept after the workers are stopped)."""
        if rank >= len(self._nodes):
            return "Ray node unknown"
        node = self._nodes[rank]
        return f"Ray node {node['node_id'][:12]} at {node['ip']}"


class _Failures:
    """What went wrong in one call: exceptions workers raised, and a worker Ray lost."""

    def __init__(self) -> None:
        self.errors: list[tuple[int, ray.exceptions.RayTaskError]] = []
        self.death: tuple[int, ray.exceptions.RayError] | None = None

    @property
    def any(self) -> bool:
        return bool(self.errors) or self.death is not None

    def raised(self, rank: int, exc: ray.exceptions.RayTaskError) -> None:
        self.errors.append((rank, exc))

    def lost(self, rank: int, exc: ray.exceptions.RayError) -> None:
        if self.death is None:
            self.death = (rank, exc)

    def first_raised(self) -> tuple[int, ray.exceptions.RayTaskError]:
        """The failure to report: the first that is not a consequence of another rank's (a
        HorovodInternalError is what peers of a failed rank raise), else the first."""
        for rank, exc in self.errors:
            if not isinstance(exc.cause, HorovodInternalError):
                return rank, exc
        return self.errors[0]


def _only_elastic(**options: Any) -> None:
    """Elastic-only arguments on a fixed-size executor are refused, never silently ignored."""
    defaults = {"elastic_timeout": 600, "override_discovery": True}
    for name, value in options.items():
        if value != defaults.get(name, None):
            raise ConfigError(f"RayExecutor: {name}={value!r} applies only to elastic jobs; give min_workers "
                              "and/or max_workers to make this one elastic")


def _positive_int(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"RayExecutor: {name} must be a positive integer, got {value!r}")


def _positive_number(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"RayExecutor: {name} must be a positive number, got {value!r}")


def _rank_layout(node_ids: list[str]) -> tuple[list[int], list[SlotInfo]]:
    """Which actor (by creation index) gets each rank, and every rank's slot: actors grouped by Ray
    node, nodes in the order their first actor was created, ranks node by node."""
    by_node: dict[str, list[int]] = {}
    for index, node_id in enumerate(node_ids):
        by_node.setdefault(node_id, []).append(index)
    order = [index for indices in by_node.values() for index in indices]
    slots = assign_slots([Host(node_id, len(indices)) for node_id, indices in by_node.items()], len(node_ids))
    return order, slots


def _label_hosts(slots: list[SlotInfo], nodes: list[dict[str, Any]]) -> list[SlotInfo]:
    """Each rank's ``HORA_HOSTNAME``: its node's address, or address and node id where several Ray
    nodes share an address (a test cluster on one machine)."""
    addresses: dict[str, set[str]] = {}
    for node in nodes:
        addresses.setdefault(node["ip"], set()).add(node["node_id"])
    labels = [node["ip"] if len(addresses[node["ip"]]) == 1 else f"{node['ip']}-{node['node_id'][:8]}"
              for node in nodes]
    return [dataclasses.replace(slot, hostname=label) for slot, label in zip(slots, labels)]


def _visible_gpus(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` per node: every GPU of the node's workers, in local-rank order, so
    device ``local_rank`` is the worker's own."""
    ids: dict[str, list[str]] = {}
    for node in nodes:  # in rank order, so each node's list is in local-rank order
        ids.setdefault(node["node_id"], []).extend(node["gpu_ids"])
    return {node_id: ",".join(gpu_ids) for node_id, gpu_ids in ids.items()}
