"""Lifecycle, topology, process sets and timeline control, shared by every binding.

``hora``, ``hora.torch`` and the other bindings re-export these, so ``hvd.init()``, ``hvd.rank()``
and friends behave identically whichever framework a script uses.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from hora import config
from hora.engine.engine import Engine, EngineSettings
from hora.engine.request import Handle, Kind, Request, signature
from hora.engine.timeline import Timeline
from hora.errors import HoraError
from hora.rendezvous.auth import new_secret
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.server import RendezvousServer
from hora.transport import create_communicator
from hora.transport.world import Topology, form_world
from hora.transport.base import Communicator

logger = logging.getLogger("hora")

# Reduce ops: Horovod's values, so code that stores or compares them keeps working.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5


class ProcessSet:
    """A subset of ranks with its own negotiation; ``process_set_id`` is set once registered."""

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        if hasattr(ranks_or_comm, "Get_group"):
            raise HoraError("process sets from MPI communicators need the MPI transport, which hora lacks yet")
        ranks = sorted(int(r) for r in ranks_or_comm)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"process set ranks must be distinct, got {list(ranks_or_comm)}")
        self.ranks: list[int] = ranks
        self.process_set_id: int | None = None

    def _require_registered(self) -> None:
        if self.process_set_id is None:
            raise ValueError(f"process set {self.ranks} is not registered: pass it to init() or add_process_set()")

    def size(self) -> int:
        self._require_registered()
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (ValueError when it is not a member)."""
        self._require_registered()
        me = rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not in process set {self.ranks}")
        return self.ranks.index(me)

    def included(self) -> bool:
        self._require_registered()
        return rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class _Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool


class _Context:
    """Everything ``init`` builds and ``shutdown`` tears down."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.engine: Engine | None = None
        self.world: Communicator | None = None
        self.store: RendezvousClient | None = None
        self.own_server: RendezvousServer | None = None
        self.topology: _Topology | None = None
        self.secret: str = ""
        self.scope: str = ""
        self.process_sets: dict[int, ProcessSet] = {}
        self.atexit_registered = False
        self.generation = itertools.count()
        self.op_names = itertools.count()


_ctx = _Context()


def _engine_settings() -> EngineSettings:
    return EngineSettings(
        fusion_threshold=int(config.get("fusion_threshold")),
        cycle_time_s=float(config.get("cycle_time")) / 1000.0,
        cache_capacity=int(config.get("cache_capacity")),
        stall_check=not config.get("stall_check_disable"),
        stall_warning_s=float(config.get("stall_check_time_seconds")),
        stall_shutdown_s=float(config.get("stall_shutdown_time_seconds")),
    )


def _connect_store() -> tuple[RendezvousClient, str, int, int]:
    """The job's store, or, for a script started without a launcher, a private one (size 1)."""
    if config.get("rendezvous_addr") is None:
        foreign = config.foreign_launcher_world_size()
        if foreign is not None:
            raise HoraError(
                f"this process is one of {foreign[1]} started by another launcher ({foreign[0]}={foreign[1]}), "
                "but hora joins only jobs started by `hora run` or hora.run(); running each process as "
                "its own job would train unsynchronised models. Start it with `hora run -np N ...`"
            )
        if config.get("size") not in (None, 1):
            raise HoraError("HORA_SIZE is set but HORA_RENDEZVOUS_ADDR is not: start workers with `hora run`")
        secret = new_secret()
        _ctx.own_server = RendezvousServer(secret).start()
        store = RendezvousClient(*_ctx.own_server.address, secret)
        return store, secret, 0, 1
    secret = config.get("secret")
    if not secret:
        raise HoraError("HORA_SECRET is not set: start workers with `hora run`")
    store = RendezvousClient(
        config.get("rendezvous_addr"), config.get("rendezvous_port"), secret,
        connect_timeout=config.get("start_timeout"),
    )
    return store, secret, int(config.get("rank")), int(config.get("size"))


def init(comm: Sequence[int] | Any | None = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Join the job: connect to every other rank and start the engine. A second call does nothing."""
    with _ctx.lock:
        if _ctx.engine is not None:
            return
        logging.getLogger("hora").setLevel(config.get("log_level").replace("TRACE", "DEBUG").replace("FATAL", "CRITICAL"))
        if comm is not None and hasattr(comm, "Get_rank"):
            raise HoraError("init(comm=<MPI communicator>) needs the MPI transport, which hora lacks yet; "
                            "pass a list of ranks or start workers with `hora run`")
        store, secret, my_rank, world_size = _connect_store()
        members = list(range(world_size)) if comm is None else sorted(int(r) for r in comm)
        if my_rank not in members:
            store.close()
            raise ValueError(f"rank {my_rank} is not in init(comm={members})")
        generation = next(_ctx.generation)
        scope = f"{config.get('job_id') or 'job'}/init{generation}/{'-'.join(map(str, members)) if comm is not None else 'world'}"
        try:
            world, topology = form_world(members.index(my_rank), members, store, scope, secret)
        except BaseException:
            store.close()
            raise
        _ctx.store, _ctx.secret, _ctx.scope, _ctx.world = store, secret, scope, world
        _ctx.topology = _topology(world, topology)

        def make_communicator(index: int, set_members: list[int], tag: str) -> Communicator:
            # Process-set members are ranks of this world (what hora.rank() returns).
            same_host = len({topology.machines[m] for m in set_members}) == 1
            kind = "shm" if same_host and len(set_members) > 1 and config.get("transport") != "tcp" else "tcp"
            return create_communicator(kind, index, set_members, store, f"{scope}/{tag}", secret)

        timeline = None
        path = config.get("timeline")
        if path and path.upper() != "DYNAMIC" and world.rank == 0:
            timeline = Timeline(path, bool(config.get("timeline_mark_cycles")))
        _ctx.engine = Engine(world, _engine_settings(), make_communicator, timeline)
        global_process_set.ranks = list(range(world.size))
        _ctx.process_sets = {0: global_process_set}
        if not _ctx.atexit_registered:
            atexit.register(shutdown)
            _ctx.atexit_registered = True
    if process_sets is not None and not isinstance(process_sets, str):
        for ps in process_sets:
            add_process_set(ps)


def _topology(world: Communicator, topology: Topology) -> _Topology:
    """Local and cross ranks as the transport found them (the launcher's claims are checked)."""
    me = world.rank
    local_rank, local_size = topology.local(me)
    cross_rank, cross_size = topology.cross(me)
    claimed = config.get("local_rank")
    if claimed is not None and world.size == (config.get("size") or 1) and claimed != local_rank:
        logger.warning("rank %d: the launcher says local rank %s, but ranks sharing this host make it %d",
                       me, claimed, local_rank)
    return _Topology(me, world.size, local_rank, local_size, cross_rank, cross_size, topology.homogeneous)


def shutdown() -> None:
    """Stop the engine and close every connection; ``init()`` afterwards starts afresh."""
    with _ctx.lock:
        engine, world, store, server = _ctx.engine, _ctx.world, _ctx.store, _ctx.own_server
        _ctx.engine = _ctx.world = _ctx.store = _ctx.own_server = None
        _ctx.topology = None
        for ps in _ctx.process_sets.values():
            if ps is not global_process_set:
                ps.process_set_id = None
        _ctx.process_sets = {}
    if engine is not None:
        engine.shutdown()
        timeline = engine.set_timeline(None)
        if timeline is not None:
            timeline.close()
    if world is not None:
        world.close()
    if store is not None:
        store.close()
    if server is not None:
        server.stop()


def is_initialized() -> bool:
    return _ctx.engine is not None


def _topo() -> _Topology:
    topology = _ctx.topology
    if topology is None:
        raise ValueError("hora has not been initialized; call hora.init() first")
    return topology


def size() -> int:
    return _topo().size


def rank() -> int:
    return _topo().rank


def local_size() -> int:
    return _topo().local_size


def local_rank() -> int:
    return _topo().local_rank


def cross_size() -> int:
    return _topo().cross_size


def cross_rank() -> int:
    return _topo().cross_rank


def is_homogeneous() -> bool:
    return _topo().homogeneous


# ---- what hora is built with: these tell the truth about hora's own transports ----------------

def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    raise ValueError("MPI is not in use: hora's transport here is its built-in TCP ring")


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


# ---- engine access for the bindings -------------------------------------------------------------

def engine() -> Engine:
    eng = _ctx.engine
    if eng is None:
        raise ValueError("hora has not been initialized; call hora.init() first")
    return eng


def process_set_id(process_set: ProcessSet | None) -> int:
    ps = global_process_set if process_set is None else process_set
    if ps.process_set_id is None:
        raise ValueError(f"process set {ps.ranks} is not registered: pass it to init() or add_process_set()")
    return ps.process_set_id


def submit_control(kind: Kind, name: str, process_set: ProcessSet | None = None, **fields: Any) -> Handle:
    """Submit a collective that carries no tensor (barrier, join, process-set changes)."""
    request = Request(name, signature(kind, "uint8", (), **fields), None, Handle(name), process_set_id(process_set))
    return engine().submit([request])[0]


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank of the job must call it, in the same order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    engine()  # raises the init() message when hora is not initialised
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    world = size()
    bad = [r for r in ps.ranks if not 0 <= r < world]
    if not ps.ranks or bad:
        raise ValueError(f"process set ranks {ps.ranks} must be non-empty and within 0..{world - 1}")
    for existing in _ctx.process_sets.values():
        if existing.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} already exists (id {existing.process_set_id})")
    handle = submit_control(Kind.PROCESS_SET, f"__process_set.{next(_ctx.op_names)}", op="add", splits=tuple(ps.ranks))
    ps.process_set_id = int(handle.wait())
    _ctx.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank calls it); False if it was not registered."""
    if process_set.process_set_id in (None, 0):
        return False
    handle = submit_control(Kind.PROCESS_SET, f"__process_set.{next(_ctx.op_names)}", op="remove",
                            root=process_set.process_set_id)
    removed = bool(handle.wait())
    _ctx.process_sets.pop(process_set.process_set_id, None)
    process_set.process_set_id = None
    return removed


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the Chrome-trace timeline (rank 0 writes; other ranks accept the call)."""
    eng = engine()
    timeline = Timeline(file_path, mark_cycles) if rank() == 0 else None
    previous = eng.set_timeline(timeline)
    if previous is not None:
        previous.close()


def stop_timeline() -> None:
    eng = engine()
    previous = eng.set_timeline(None)
    if previous is not None:
        previous.close()


def next_name(kind: str) -> str:
    return engine().auto_name(kind)
