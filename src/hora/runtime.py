"""Where a process's hora runtime is assembled and taken apart.

``init()`` needs, in order: the worker's identity (:mod:`hora.workers.identity`), a connection to the
job's rendezvous store (or a private store for a script started on its own), a rendezvous round to
join (:mod:`hora.rendezvous.rounds`), the world's communicator and topology
(:mod:`hora.transport.world`), and the engine. :func:`assemble` does exactly that and returns a
:class:`Runtime`; :meth:`Runtime.close` undoes it. :mod:`hora.basics` keeps one Runtime and the
public API (rank, size, process sets...) on top of it, and knows nothing of stores or sockets.

Every world is a rendezvous round. The first ``init()`` of a process joins round 0 (the launcher's
ranks); ``shutdown()`` then ``init()`` joins the next round: in elastic mode the one the driver
opens (it says which host slot gets which rank), otherwise the first worker to re-initialise opens
it with the previous round's plan and the others join that one.
"""

from __future__ import annotations

import itertools
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from hora import config
from hora.engine.autotune import AutotuneConfig
from hora.engine.engine import Engine, EngineSettings
from hora.engine.timeline import Timeline
from hora.errors import ConfigError, HoraError
from hora.mpi import abort_on_exception as mpi_abort_on_exception, bootstrap as mpi_bootstrap
from hora.nccl.context import DeviceContext
from hora.rendezvous.auth import new_secret
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.rounds import Round, StaleRoundError
from hora.rendezvous.server import RendezvousServer
from hora.transport import create_communicator, mpi_world as mpi_state, world as world_formation
from hora.transport.base import Communicator
from hora.transport.topology import Topology
from hora.workers import identity, launcher_env

logger = logging.getLogger("hora")


@dataclass(frozen=True)
class Coordinates:
    """This process's place in the formed world, as the transport found it (not as claimed)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool


@dataclass(frozen=True)
class Joined:
    """The round a worker took part in and the slot it held, remembered across ``shutdown()`` so the
    next ``init()`` joins the round after it."""

    round: Round
    private: bool
    job: str  # the job's id: a process that later joins another job starts at that job's round 0


class Runtime:
    """One assembled world: its store connection, round, communicator, coordinates and engine."""

    def __init__(self, store: RendezvousClient, own_server: RendezvousServer | None, joined: Joined,
                 world: Communicator, coordinates: Coordinates, engine: Engine) -> None:
        self.store = store
        self.own_server = own_server
        self.joined = joined
        self.world = world
        self.coordinates = coordinates
        self.engine = engine

    @property
    def round(self) -> Round:
        return self.joined.round

    def close(self) -> None:
        """Stop the engine and close every connection. Never raises: shutdown must always leave a
        clean process, whatever state a failure left the pieces in."""
        engine, self.engine = self.engine, None  # type: ignore[assignment]  # closed for good: never used again
        if engine is not None:
            _quietly("stopping the engine", engine.shutdown)
            timeline = _quietly("detaching the timeline", engine.set_timeline, None)
            if timeline is not None:
                _quietly("closing the timeline", timeline.close)
        _close_connections(self.world, self.store, self.own_server)
        self.world = self.store = self.own_server = None  # type: ignore[assignment]  # as self.engine above


_T = TypeVar("_T")


def identity_for_init(environ: Mapping[str, str] | None = None) -> identity.WorkerIdentity | None:
    """The identity ``init()`` joins its job with; None for a script started on its own.

    A script started without a launcher forms a private size-1 job. One started by another launcher
    (mpirun, mpiexec, srun) joins that launcher's job: its rank comes from the launcher's variables
    and rank 0 serves the store (:mod:`hora.mpi.bootstrap`), or a clear error says why the ranks
    cannot find each other. A partial identity (``HORA_SIZE=4`` but no rendezvous address, a
    missing secret...) is refused with the names of the missing variables.
    """
    if not config.is_set("rendezvous_addr", environ) and not config.is_set("rank", environ):
        launched = launcher_env.detect(environ)
        if launched is not None:
            return mpi_bootstrap.identity_from_launcher(launched)
    if not config.is_set("rendezvous_addr", environ):
        if config.get("size", environ) not in (None, 1):
            raise HoraError(f"{config.knob('size').env} is set but {config.knob('rendezvous_addr').env} "
                            "is not: start workers with `hora run`")
        return None
    return identity.from_environment(environ)


def _quietly(what: str, func: Callable[..., _T], *args: object) -> _T | None:
    try:
        return func(*args)
    except Exception as exc:  # teardown goes on whatever one piece does
        logger.warning("hora shutdown: %s failed: %s", what, exc)
        return None


def _close_connections(world: Communicator | None, store: RendezvousClient | None,
                       server: RendezvousServer | None) -> None:
    if world is not None:
        _quietly("closing the world's connections", world.close)
    if store is not None:
        _quietly("closing the rendezvous connection", store.close)
    if server is not None:
        _quietly("stopping the private rendezvous server", server.stop)


def engine_settings() -> EngineSettings:
    """The engine's knobs from the config table."""
    return EngineSettings(
        fusion_threshold=int(config.get("fusion_threshold")),
        cycle_time_s=float(config.get("cycle_time")) / 1000.0,
        cache_capacity=int(config.get("cache_capacity")),
        stall_check=not config.get("stall_check_disable"),
        stall_warning_s=float(config.get("stall_check_time_seconds")),
        stall_shutdown_s=float(config.get("stall_shutdown_time_seconds")),
    )


def autotune_config() -> AutotuneConfig | None:
    """The autotuner's settings from the config table, or None when autotune is off. Knobs the user
    set explicitly are held fixed, as Horovod holds them."""
    if not config.get("autotune"):
        if config.get("autotune_log") and config.is_set("autotune_log"):
            logger.warning("%s is set but autotune is off (set %s=1): no autotune log is written",
                           config.knob("autotune_log").env, config.knob("autotune").env)
        return None
    try:
        import sklearn  # noqa: F401 - only to check it is installed: the Gaussian process needs it
    except ImportError:
        raise ConfigError(f"{config.knob('autotune').env} needs scikit-learn for its Gaussian process: "
                          "pip install 'hora[autotune]'") from None
    return AutotuneConfig(
        warmup_samples=int(config.get("autotune_warmup_samples")),
        steps_per_sample=max(1, int(config.get("autotune_steps_per_sample"))),
        bayes_opt_max_samples=max(1, int(config.get("autotune_bayes_opt_max_samples"))),
        gaussian_process_noise=float(config.get("autotune_gaussian_process_noise")),
        log_file=config.get("autotune_log"),
        fixed_fusion=config.is_set("fusion_threshold"),
        fixed_cycle=config.is_set("cycle_time"),
        fixed_cache=config.is_set("cache_capacity"),
        fixed_hierarchical=config.is_set("hierarchical_allreduce"),
    )


def _set_log_level() -> None:
    level = str(config.get("log_level")).replace("TRACE", "DEBUG").replace("FATAL", "CRITICAL")
    logging.getLogger("hora").setLevel(level)


def _choose_round(store: RendezvousClient, me: identity.WorkerIdentity | None,
                  previous: Joined | None) -> tuple[Round, int]:
    """The round to join and this worker's rank in it."""
    size = 1 if me is None else me.size
    if previous is None or previous.private or me is None or previous.job != me.job_id:
        opened = store.open_round(size, expect_current=-1)  # round 0, or the one already open
    elif config.get("elastic"):
        timeout = float(config.get("start_timeout"))
        found = store.wait_round(previous.round.generation, timeout)
        if found is None:
            raise HoraError(f"no rendezvous round after {previous.round.generation} was opened within "
                            f"{timeout:.0f} s; the elastic driver opens the next round")
        opened = found
    else:
        last = previous.round
        opened = store.open_round(last.size, last.hosts, expect_current=last.generation)
    if me is None:
        return opened, 0
    if opened.hosts:
        rank = opened.rank_for(me.hostname, me.local_rank)
        if rank is None and config.get("elastic"):
            raise NotInRoundError(f"rendezvous round {opened.generation} has no slot for {me.hostname} "
                                  f"slot {me.local_rank}: the elastic driver left this worker out of the "
                                  f"job's world (its hosts are now {_plan_text(opened)})")
        if rank is None:
            raise HoraError(f"rendezvous round {opened.generation} has no slot for {me.hostname} slot "
                            f"{me.local_rank} (its hosts are {list(opened.hosts)})")
        return opened, rank
    if opened.size != me.size:
        raise HoraError(f"rendezvous round {opened.generation} has {opened.size} ranks but "
                        f"{config.knob('size').env}={me.size}")
    return opened, me.rank


class NotInRoundError(HoraError):
    """An elastic worker whose host slot the driver left out of the new world: it has nothing to do."""


def _plan_text(opened: Round) -> str:
    return ",".join(f"{host}:{slots}" for host, slots in opened.hosts)


def assemble(comm: Sequence[int] | Any | None, previous: Joined | None) -> Runtime:
    """Join the job and build everything ``init()`` provides; on failure close what was built.

    ``comm`` limits the world to those ranks (of the round), or is an mpi4py communicator whose
    members form the world (:mod:`hora.mpi.bootstrap`); ``previous`` is what the last runtime of
    this process joined (None at the first ``init()``).
    """
    _set_log_level()
    if mpi_bootstrap.is_mpi_comm(comm):
        me: identity.WorkerIdentity | None = mpi_bootstrap.identity_from_comm(comm)  # its ranks are the world
        comm = None
    else:
        me = identity_for_init()
    mpi_state.mark_in_use(False)
    server: RendezvousServer | None = None
    store: RendezvousClient | None = None
    world: Communicator | None = None
    timeline: Timeline | None = None
    try:
        if me is None:
            secret = new_secret()
            server = RendezvousServer(secret).start()
            store = RendezvousClient(*server.address, secret)
            hostname = socket.gethostname()
        else:
            secret = me.secret
            store = RendezvousClient(me.rendezvous_addr, me.rendezvous_port, secret,
                                     connect_timeout=float(config.get("start_timeout")))
            hostname = me.hostname
        while True:
            current, my_rank = _choose_round(store, me, previous)
            members = list(range(current.size)) if comm is None else sorted(int(r) for r in comm)
            if my_rank not in members:
                raise ValueError(f"rank {my_rank} is not in init(comm={members})")
            scope = current.prefix + ("world" if comm is None else "world-" + "-".join(map(str, members)))
            try:
                joined = Joined(store.join_round(current.generation, my_rank, hostname), private=me is None,
                                job="" if me is None else me.job_id)
                world, topology = world_formation.form_world(members.index(my_rank), members, store,
                                                             scope, secret, config.get("host_id"))
                break
            except StaleRoundError:
                # The elastic driver replaced this round before its world formed (another worker
                # failed meanwhile, or hosts changed again): join the round that replaced it.
                if me is None or not config.get("elastic"):
                    raise
                logger.info("rank %d: rendezvous round %d was replaced before its world formed; "
                            "joining the next one", my_rank, current.generation)
                if world is not None:
                    _quietly("closing a half-formed world", world.close)
                    world = None
                previous = Joined(current, private=False, job=me.job_id)
        coordinates = _coordinates(world, topology, me)
        mpi_state.mark_in_use(world.name == "mpi" or (me is not None and mpi_state.base_comm() is not None
                                                      and me.size == mpi_state.base_comm().Get_size()))
        if mpi_state.base_comm() is not None:
            mpi_abort_on_exception.install()
        tuning = autotune_config()

        def make_communicator(index: int, set_members: list[int], tag: str) -> Communicator:
            # Process-set members are ranks of this world (what hora.rank() returns); the set gets
            # the transport world formation would choose for where its ranks run.
            hosts = Topology(tuple(topology.machines[m] for m in set_members))
            return world_formation.connect_group(index, set_members, store, f"{scope}/{tag}", secret, hosts)

        path = config.get("timeline")
        if path and path.upper() != "DYNAMIC" and world.rank == 0:
            timeline = Timeline(path, bool(config.get("timeline_mark_cycles")))
        settings = engine_settings()
        device = DeviceContext(store, scope, world.rank, settings.fusion_threshold,
                               float(config.get("start_timeout")), world,
                               bool(config.get("hierarchical_allreduce")))
        engine = Engine(world, settings, make_communicator, timeline, device)
        if tuning is not None:
            engine.enable_autotune(replace(tuning, log_file=tuning.log_file if world.rank == 0 else None))
    except BaseException:
        if timeline is not None:
            _quietly("closing the timeline", timeline.close)
        _close_connections(world, store, server)
        raise
    return Runtime(store, server, joined, world, coordinates, engine)


def _coordinates(world: Communicator, topology: Topology,
                 me: identity.WorkerIdentity | None) -> Coordinates:
    """Local and cross ranks as the transport found them (the launcher's claims are checked)."""
    rank = world.rank
    local_rank, local_size = topology.local(rank)
    cross_rank, cross_size = topology.cross(rank)
    # An elastic driver's hosts are its own units (localhost and 127.0.0.1 are two of them), so its
    # slot numbers need not match the kernel's view of who shares a machine.
    if me is not None and world.size == me.size and me.local_rank != local_rank and not config.get("elastic"):
        logger.warning("rank %d: the launcher says local rank %s, but ranks sharing this host make it %d",
                       rank, me.local_rank, local_rank)
    return Coordinates(rank, world.size, local_rank, local_size, cross_rank, cross_size, topology.homogeneous)


_connect_world_calls = itertools.count()


def connect_world(transport: str | None = None, store: RendezvousClient | None = None,
                  machine: str | None = None, **options: object) -> Communicator:
    """The communicator of every rank in a job started by ``hora run`` / :func:`hora.run`.

    ``transport`` names a registered transport to use as is; None forms the world as ``init`` does.
    ``machine`` emulates this rank's host identity (see :func:`form_world`).
    Every rank must call it the same number of times: each call forms a new, separate group.
    """
    me = identity.from_environment()  # names every missing variable, refuses rank >= size
    rank, size, secret = me.rank, me.size, me.secret
    if store is None:
        store = RendezvousClient(me.rendezvous_addr, me.rendezvous_port, secret,
                                 connect_timeout=config.get("start_timeout"))
    scope = f"{me.job_id}/world/{next(_connect_world_calls)}"
    members = list(range(size))
    if transport is None:
        return world_formation.form_world(rank, members, store, scope, secret, machine)[0]
    if machine is not None:
        options["machine"] = machine
    return create_communicator(transport, rank, members, store, scope, secret, **options)
