"""``hora.ray.ElasticRayExecutor`` and the elastic form of ``RayExecutor``: their arguments, checked once.

Both are horovod.ray's, so Horovod-on-Ray scripts keep working after the import changes:

- ``ElasticRayExecutor(ElasticRayExecutor.create_settings(min_np=..., max_np=...), cpus_per_slot=...)``,
  then ``start()`` and ``run(worker_fn, callbacks=None)``;
- ``RayExecutor(settings, min_workers=..., max_workers=..., cpus_per_worker=...)``, then ``start()``
  and ``run(fn, args, kwargs, callbacks)``.

Each ``run`` is one elastic job (:func:`hora.ray.elastic.run_elastic_job`): workers start on the
cluster's live nodes, the world grows as nodes join (up to the maximum) and re-forms when nodes leave
or workers die, and the call returns each rank's result of the final world, in rank order. ``fn``
must be written for elastic training (``hvd.elastic.run`` around the loop, state committed).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ray

from hora.errors import ConfigError, HoraError, LaunchError
from hora.ray.elastic import DEFAULT_COOLDOWN_RANGE, ElasticRayOptions, RayActorLauncher, run_elastic_job
from hora.ray.placement import WorkerResources
from hora.runner.elastic.driver import ElasticOutcome

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ElasticRaySettings:
    """What :meth:`ElasticRayExecutor.create_settings` returns (horovod.ray's elastic settings).

    ``min_np``/``max_np``: the world's bounds (``max_np`` None: as many workers as the nodes hold).
    ``reset_limit``: how often the world may re-form. ``elastic_timeout``: how long the job waits for
    ``min_np`` workers, or for a round to form. ``timeout_s``: how long Ray may take to start and
    configure a worker's actor (one it cannot place in that time counts as a failed start); in
    ``hvd.init()`` workers wait for each other up to the larger of ``timeout_s`` and
    ``elastic_timeout``, as under ``hora run``. ``cooldown_range``: seconds a node whose worker failed stays out
    (default ``DEFAULT_COOLDOWN_RANGE``; see docs/ray.md). ``discovery``: the hosts source used when
    the executor is built with ``override_discovery=False``.
    """

    min_np: int = 1
    max_np: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    cooldown_range: tuple[float, float] | None = DEFAULT_COOLDOWN_RANGE
    nics: set[str] | None = None
    ssh_identity_file: str | None = None
    verbose: int = 1
    discovery: Any = None


def _positive(owner: str, name: str, value: Any, integer: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    wrong = isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
    if wrong or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ConfigError(f"{owner}: {name} must be {kind}, got {value!r}")


def _one_of(owner: str, name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """Horovod's two spellings of one argument: either, or both equal."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ConfigError(f"{owner}: give {name} or {alias}, not both ({name}={value!r}, {alias}={alias_value!r})")
    return value if value is not None else alias_value


def resolve_cooldown(owner: str, cooldown_range: Sequence[float] | None) -> tuple[float, float]:
    """``cooldown_range`` as the driver takes it: None gives ``DEFAULT_COOLDOWN_RANGE`` (a Ray node
    whose worker failed gets another chance; Horovod's None keeps it out for good, which
    ``(math.inf, math.inf)`` still asks for), two numbers are the range."""
    if cooldown_range is None:
        return DEFAULT_COOLDOWN_RANGE
    values = list(cooldown_range)
    if (len(values) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values)
            or values[0] < 0 or values[0] > values[1]):
        raise ConfigError(f"{owner}: cooldown_range needs two numbers 0 <= MIN <= MAX, got {cooldown_range!r}")
    return float(values[0]), float(values[1])


def _nic_set(nics: Iterable[str] | str | None) -> set[str] | None:
    if isinstance(nics, str):
        nics = nics.split(",")
    return {str(name).strip() for name in nics or () if str(name).strip()} or None


def check_bounds(owner: str, min_np: int, max_np: int | None, np: int | None = None) -> None:
    _positive(owner, "the minimum number of workers", min_np, integer=True)
    _positive(owner, "the maximum number of workers", max_np, integer=True, allow_none=True)
    if max_np is not None and min_np > max_np:
        raise ConfigError(f"{owner}: the minimum number of workers ({min_np}) is greater than the maximum ({max_np})")
    if np is not None and (np < min_np or (max_np is not None and np > max_np)):
        raise ConfigError(f"{owner}: num_workers={np} is outside [{min_np}, {max_np if max_np is not None else 'any'}]")


class ElasticJobRunner:
    """The part both elastic executors share: ``start`` checks Ray, ``run`` runs one elastic job."""

    def __init__(self, owner: str, options: ElasticRayOptions) -> None:
        self.owner = owner
        self.options = options
        self.started = False
        self.launcher: RayActorLauncher | None = None
        self.last_outcome: ElasticOutcome | None = None

    def start(self) -> None:
        if not ray.is_initialized():
            ray.init()  # as Ray's own first remote call would
        if ray.util.client.ray.is_connected():
            raise LaunchError(f"{self.owner} needs a driver that runs on a node of the Ray cluster (workers "
                              "connect to the rendezvous store it serves); Ray Client (ray://) is not supported")
        from ray.util.placement_group import get_current_placement_group

        if get_current_placement_group() is not None:
            logger.warning("%s: running inside a placement group (a Ray Tune trial?): an elastic job does not use "
                           "it; its workers take the resources they need from the nodes' free ones", self.owner)
        self.started = True

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
            callbacks: Sequence[Callable[[Any], Any]] | None) -> list[Any]:
        if not self.started:
            raise HoraError(f"{self.owner}.run: the executor is not started (call start() first)")

        def keep(launcher: RayActorLauncher) -> None:
            self.launcher = launcher

        results, self.last_outcome = run_elastic_job(self.options, fn, args, kwargs, callbacks, on_start=keep)
        return results

    @property
    def workers(self) -> list[Any]:
        """Actor handles of the workers running now, in start order (empty outside ``run``)."""
        launcher = self.launcher
        if launcher is None:
            return []
        return [worker.actor for worker in list(launcher.workers) if worker.ready and worker.alive()]

    def shutdown(self) -> None:
        self.started = False


class ElasticRayExecutor:
    """horovod.ray's ``ElasticRayExecutor``: elastic training on the Ray cluster's live nodes.

    ``settings`` from :meth:`create_settings`. Each worker reserves ``cpus_per_slot`` CPUs and, with
    ``use_gpu``, ``gpus_per_slot`` GPUs (default 1); a node holds as many workers as its free
    resources allow. ``env_vars`` are set in every worker. With ``override_discovery=False`` the hosts
    come from ``settings.discovery`` (an object with ``find_available_hosts_and_slots()``, or a
    function, returning ``{host: slots}`` with hosts named by their Ray node address or host name)
    instead of Ray's node table.
    """

    @staticmethod
    def create_settings(min_num_proc: int | None = None, max_num_proc: int | None = None,
                        reset_limit: int | None = None, elastic_timeout: float = 600, timeout_s: float = 30,
                        ssh_identity_file: str | None = None, nics: Iterable[str] | str | None = None,
                        min_np: int | None = None, max_np: int | None = None,
                        cooldown_range: Sequence[float] | None = None,
                        verbose: int = 1, **kwargs: Any) -> ElasticRaySettings:
        """The executor's settings (horovod.ray's signature, ``min_np``/``max_np`` being the older
        spellings of ``min_num_proc``/``max_num_proc``; see :class:`ElasticRaySettings`).
        ``cooldown_range`` None (the default): ``DEFAULT_COOLDOWN_RANGE``. Other keyword arguments Horovod
        passes on to its settings object are accepted and named in a warning: none of them changes
        anything here."""
        owner = "ElasticRayExecutor.create_settings"
        if kwargs:
            logger.warning("%s: %s not used by hora.ray (accepted for horovod.ray compatibility)", owner,
                           ", ".join(sorted(kwargs)))
        low = _one_of(owner, "min_num_proc", min_num_proc, "min_np", min_np)
        high = _one_of(owner, "max_num_proc", max_num_proc, "max_np", max_np)
        low = 1 if low is None else low
        check_bounds(owner, low, high)
        _positive(owner, "elastic_timeout", elastic_timeout)
        _positive(owner, "timeout_s", timeout_s)
        if reset_limit is not None and (isinstance(reset_limit, bool) or not isinstance(reset_limit, int)
                                        or reset_limit < 0):
            raise ConfigError(f"{owner}: reset_limit must be a non-negative integer, got {reset_limit!r}")
        if ssh_identity_file is not None:
            logger.warning("hora.ray: ssh_identity_file is not used: Ray starts every worker, no SSH")
        return ElasticRaySettings(min_np=low, max_np=high, reset_limit=reset_limit,
                                  elastic_timeout=float(elastic_timeout), timeout_s=float(timeout_s),
                                  cooldown_range=resolve_cooldown(owner, cooldown_range), nics=_nic_set(nics),
                                  ssh_identity_file=ssh_identity_file, verbose=verbose)

    def __init__(self, settings: ElasticRaySettings, use_gpu: bool = False, cpus_per_slot: float | None = None,
                 gpus_per_slot: float | None = None, env_vars: Mapping[str, str] | None = None,
                 override_discovery: bool = True, cpus_per_worker: float | None = None,
                 gpus_per_worker: float | None = None) -> None:
        owner = "ElasticRayExecutor"
        if settings is None:
            settings = self.create_settings()
        cpus = _one_of(owner, "cpus_per_slot", cpus_per_slot, "cpus_per_worker", cpus_per_worker)
        gpus = _one_of(owner, "gpus_per_slot", gpus_per_slot, "gpus_per_worker", gpus_per_worker)
        cpus = 1 if cpus is None else cpus
        _positive(owner, "cpus_per_slot", cpus)
        if gpus is not None and not use_gpu:
            raise ConfigError(f"{owner}: gpus_per_slot={gpus} needs use_gpu=True")
        gpus = (1 if gpus is None else gpus) if use_gpu else 0
        if use_gpu:
            _positive(owner, "gpus_per_slot", gpus)
        discovery = None
        if not override_discovery:
            discovery = getattr(settings, "discovery", None)
            if discovery is None:
                raise ConfigError(f"{owner}: override_discovery=False needs settings.discovery (the hosts "
                                  "source to use instead of Ray's node table)")
        self.settings = settings
        options = ElasticRayOptions(
            min_np=settings.min_np, max_np=settings.max_np, np=None,
            resources=WorkerResources(float(cpus), float(gpus)), timeout_s=float(settings.timeout_s),
            elastic_timeout=float(settings.elastic_timeout), reset_limit=settings.reset_limit,
            cooldown_range=settings.cooldown_range,
            nics=tuple(sorted(settings.nics)) if settings.nics else None,
            env=tuple((str(k), str(v)) for k, v in (env_vars or {}).items()), discovery=discovery)
        self._job = ElasticJobRunner(owner, options)

    def start(self) -> None:
        """Connect to Ray (``ray.init()`` if nothing did yet); workers start in ``run``."""
        self._job.start()

    def run(self, worker_fn: Callable[[], Any], callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Run ``worker_fn()`` as one elastic job: each rank's result of the final world, in rank order.

        Values workers send with :func:`hora.ray.ray_logger.log` reach ``callbacks`` as they come.
        A job that cannot go on (fewer than ``min_np`` workers for ``elastic_timeout``, the
        ``reset_limit`` reached) raises :class:`hora.errors.LaunchError` saying which bound, with the
        last exception a worker raised as its cause.
        """
        return self._job.run(worker_fn, None, None, callbacks)

    @property
    def workers(self) -> list[Any]:
        """Actor handles of the workers running now (empty outside ``run``)."""
        return self._job.workers

    @property
    def last_outcome(self) -> ElasticOutcome | None:
        """How the last ``run`` went: its rounds, resets, failures and recovery times."""
        return self._job.last_outcome

    def shutdown(self) -> None:
        """Forget the start (each ``run`` already stopped its workers)."""
        self._job.shutdown()
