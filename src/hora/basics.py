"""Lifecycle, topology, process sets and timeline control, shared by every binding.

``hora``, ``hora.torch`` and the other bindings re-export these, so ``hvd.init()``, ``hvd.rank()``
and friends behave identically whichever framework a script uses.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

from hora import mpi as hora_mpi
from hora.engine.engine import Engine
from hora.engine.request import Handle, Kind, Request, signature
from hora.engine.timeline import Timeline
from hora.mpi import bootstrap as mpi_bootstrap, ranks as mpi_ranks
from hora.runtime import Coordinates, Joined, NotInRoundError, Runtime, assemble
from hora.transport.base import ReduceOp

logger = logging.getLogger("hora")

# Reduce ops: the one ReduceOp type, with Horovod's values, so code that stores or compares them keeps working.
Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


class ProcessSet:
    """A subset of ranks with its own negotiation; ``process_set_id`` is set once registered."""

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        if mpi_bootstrap.is_mpi_comm(ranks_or_comm):
            ranks_or_comm = mpi_ranks.world_ranks(ranks_or_comm)
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


class _Context:
    """The process's runtime (what ``init`` assembled) and the process sets registered on it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.runtime: Runtime | None = None
        # runtime.engine and runtime.coordinates, kept apart: collectives read them on every call
        self.engine: Engine | None = None
        self.coordinates: Coordinates | None = None
        self.last_joined: Joined | None = None  # the round the last runtime took part in
        self.last_rank: int | None = None  # this process's rank in that round (hora.run's results)
        self.process_sets: dict[int, ProcessSet] = {}
        self.atexit_registered = False
        self.op_names = itertools.count()


_ctx = _Context()


def init(comm: Sequence[int] | Any | None = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Join the job: connect to every other rank and start the engine. A second call does nothing.

    After ``shutdown()``, ``init()`` joins the job's next rendezvous round (see :mod:`hora.runtime`).
    A failed ``init()`` leaves nothing behind: the process is as if it had never been called.
    """
    with _ctx.lock:
        if _ctx.runtime is not None:
            return
        try:
            runtime = assemble(comm, _ctx.last_joined)
        except NotInRoundError as exc:
            # Elastic: the driver dropped this worker's host (or slot) from the world. There is
            # nothing left for it to do, and exiting cleanly is how the driver expects it to leave.
            logger.warning("%s; this worker exits", exc)
            raise SystemExit(0) from None
        _ctx.runtime, _ctx.last_joined = runtime, runtime.joined
        _ctx.last_rank = runtime.coordinates.rank
        _ctx.engine, _ctx.coordinates = runtime.engine, runtime.coordinates
        global_process_set.ranks = list(range(runtime.coordinates.size))
        _ctx.process_sets = {0: global_process_set}
        if not _ctx.atexit_registered:
            atexit.register(shutdown)
            _ctx.atexit_registered = True
    if process_sets is not None and not isinstance(process_sets, str):
        for ps in process_sets:
            add_process_set(ps)


def shutdown() -> None:
    """Stop the engine and close every connection; ``init()`` afterwards starts afresh.

    Safe at any time: before ``init()``, twice, or after a failed ``init()``; it never raises and
    always leaves hora uninitialised with no process set registered (what a test fixture wants).
    """
    with _ctx.lock:
        runtime, _ctx.runtime, _ctx.engine, _ctx.coordinates = _ctx.runtime, None, None, None
        for ps in _ctx.process_sets.values():
            if ps is not global_process_set:
                ps.process_set_id = None
        _ctx.process_sets = {}
        global_process_set.ranks = []
    if runtime is not None:
        runtime.close()


def reset() -> None:
    """``shutdown()``, and also forget which rendezvous round this process last joined, so the next
    ``init()`` behaves as the process's first (it joins round 0). For test fixtures that want every
    test to start from a never-initialised process, and for processes that serve one job after
    another (Spark's reused Python workers); a job's own code calls ``shutdown()``."""
    shutdown()
    with _ctx.lock:
        _ctx.last_joined = None
        _ctx.last_rank = None


def is_initialized() -> bool:
    return _ctx.runtime is not None


def _topo() -> Coordinates:
    coordinates = _ctx.coordinates
    if coordinates is None:
        raise ValueError("hora has not been initialized; call hora.init() first")
    return coordinates


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
    """Whether hora can use MPI here: mpi4py imports and loads its MPI library."""
    return hora_mpi.built()


def mpi_enabled() -> bool:
    """Whether this job was formed over MPI (mpirun with mpi4py, init(comm=...)) or uses the MPI transport."""
    return hora_mpi.enabled()


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE; ValueError when MPI is not in use."""
    return hora_mpi.threads_supported()


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """NCCL's version code (e.g. 23203 for 2.32.3) when the NCCL library loads, else 0.

    Horovod answers whether it was compiled with NCCL; hora binds NCCL at run time, so the answer
    is whether the library is installed (``hora[cuda]``). It needs no GPU: ``hora check`` says
    whether the device path is also usable (CUDA driver and device) and why not.
    """
    from hora.nccl.library import nccl_version

    return nccl_version()


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether hora's GPU path is installed: NCCL and the CUDA runtime both load (``hora[cuda]``; no GPU needed)."""
    from hora.nccl.cudart import runtime_installed
    from hora.nccl.library import nccl_version

    return nccl_version() > 0 and runtime_installed()


def rocm_built() -> bool:
    return False


def bytes_sent() -> int | None:
    """Bytes this rank's transports have sent to its peers since ``init()``, read from their own
    counters (a hora addition; Horovod has none): what a collective, a compression setting or a
    training step costs on the wire, as the difference of two readings. Every process set's
    traffic and the engine's negotiation count; shared memory between ranks of one host moves no
    network bytes. ``None`` under the MPI transport, which sends inside its library."""
    return engine().bytes_sent()


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
    handle = engine().add_process_set(ps.ranks, f"__process_set.{next(_ctx.op_names)}")
    ps.process_set_id = int(handle.wait())
    _ctx.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank calls it); False if it was not registered."""
    if process_set.process_set_id in (None, 0):
        return False
    handle = engine().remove_process_set(process_set.process_set_id, f"__process_set.{next(_ctx.op_names)}")
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


def next_name(kind: str, process_set: ProcessSet | None = None) -> str:
    """A name for an unnamed collective of ``kind`` on ``process_set`` (default: the global set),
    counted among that set's members only: collectives on a set some ranks are not in must leave
    every other set's names in step."""
    return engine().auto_name(kind, process_set_id(process_set))
