"""The process's device side for one world: its GPU, hora's stream, and NCCL communicators by set.

The engine owns one :class:`DeviceContext` per world. Nothing in it touches CUDA or NCCL until a CUDA
tensor is negotiated for the NCCL path, so a CPU job never loads either library. Then the first
item's device becomes the process's device (one GPU per process, as in Horovod), hora's stream and
the device fusion buffer are made on it, and each process set gets its communicator, its unique id
carried by the world's authenticated rendezvous under the world's scope. :meth:`DeviceContext.close`
(engine shutdown: ``hora.shutdown()``, an elastic reset) destroys them all; the next world has a new
scope, so it never reads an old unique id.

When a peer fails or device work stalls, :meth:`DeviceContext.abort` aborts every communicator at
once (``ncclCommAbort``): NCCL's kernels wait for a dead peer forever, and so would anything that
synchronises with them, the framework's next GPU sync included. The engine calls it when it fails;
a set's runner calls it when its own watch (:meth:`hora.nccl.dispatch.DeviceExecutor.poll`) finds
work past the stall limit (:func:`stall_limit`). The first abort of a world is recorded in the
rendezvous store, so every rank's error names the root cause, as the host transports' do.

The CUDA runtime and NCCL come from :func:`set_backend`'s factory when one is set: the tests drive
this whole path on CPU through a host-memory emulation of both (``tests/nccl/nccl_emulation.py``).
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hora import config
from hora.errors import HoraError, HorovodInternalError
from hora.nccl.communicators import CommunicatorTable, Store
from hora.nccl.dispatch import DeviceExecutor
from hora.nccl.ops import DeviceCollectives
from hora.transport.base import Communicator, ReduceOp

logger = logging.getLogger("hora")

#: () -> (CUDA runtime, NCCL): the real libraries unless a test installed an emulation.
BackendFactory = Callable[[], tuple[Any, Any]]

_backend_factory: BackendFactory | None = None
_backend_reason = ""


def set_backend(factory: BackendFactory | None, reason: str = "") -> None:
    """Use ``factory``'s CUDA runtime and NCCL instead of the libraries (None: the libraries again).

    ``reason`` is what :func:`ready` reports for it (the path choice's log line and errors).
    """
    global _backend_factory, _backend_reason
    _backend_factory, _backend_reason = factory, reason


def ready() -> tuple[bool, str]:
    """Whether the NCCL path can run in this process, and why not (read once per CUDA tensor path
    choice; a CPU tensor never asks)."""
    if _backend_factory is not None:
        return True, _backend_reason or "a test backend"
    return _real_status()


@functools.lru_cache(maxsize=1)
def _real_status() -> tuple[bool, str]:
    """Asked once per process: the answer does not change, and asking costs CUDA driver calls on
    every CUDA tensor's path choice (every gradient of every step)."""
    from hora.nccl.library import nccl_status

    return nccl_status()


def stall_limit() -> float:
    """Seconds NCCL work may run on the GPU, once started, before hora aborts its communicators.

    The stall shutdown time when the stall inspector has one (the bound on a collective some rank
    never joins, on the CPU path too), else the transport timeout (the bound a host collective gets
    for a peer that makes no progress). Never unbounded: a dead peer's NCCL kernel never finishes.
    """
    shutdown = float(config.get("stall_shutdown_time_seconds"))
    if shutdown > 0 and not config.get("stall_check_disable"):
        return shutdown
    return float(config.get("transport_timeout"))


def _real_backend() -> tuple[Any, Any]:
    from hora.nccl.cudart import CudaRuntime
    from hora.nccl.library import Nccl

    return CudaRuntime(), Nccl()


class DeviceContext:
    """One world's device resources on this rank, made on first use and closed with the engine."""

    def __init__(self, store: Store, scope: str, global_rank: int, fusion_threshold: int,
                 timeout: float = 60.0, world: Communicator | None = None, hierarchical: bool = False,
                 limit: float | None = None) -> None:
        self._store = store
        self._scope = scope
        self.global_rank = global_rank
        self._fusion_threshold = fusion_threshold
        self._timeout = timeout
        self._world = world
        self._hierarchical = hierarchical
        self._lock = threading.Lock()
        self._cuda: Any = None
        self._collectives: DeviceCollectives | None = None
        self._table: CommunicatorTable | None = None
        self.device: int | None = None
        self._closed = False
        #: seconds device work may run once started (None: :func:`stall_limit`, read at first use)
        self._limit = limit
        self._failure: str | None = None  # why the communicators were aborted
        self.who = f"rank {global_rank} on {socket.gethostname()}"

    # ---- the engine's side ----------------------------------------------------------------------

    def runner(self, set_id: int, members: list[int]) -> SetRunner:
        """What the executor of set ``set_id`` (global ranks ``members``) hands device items to."""
        return SetRunner(self, set_id, members)

    def release(self, set_id: int) -> None:
        """The set was removed: destroy its communicator (a new set with its id gets a new epoch)."""
        if self._table is not None:
            self._table.release(set_id)

    def abort(self, reason: str, announce: Callable[[str], None] | None = None) -> str:
        """Abort every NCCL communicator now (``ncclCommAbort``): a peer failed or device work stalled.

        An NCCL kernel waiting for a peer that is gone spins until its communicator is aborted, and
        so does anything that synchronises with it (the framework's next GPU sync); aborting ends
        them. Safe from any thread and more than once. Returns what to add to the failure's message:
        that this rank aborted and, when another rank aborted first, that rank and its reason ('' when
        there was nothing to abort). ``announce`` gets that note before the communicators are aborted
        (the engine fails its requests then: a thread the abort releases may submit at once). Later
        device collectives on this context fail; the next world (``shutdown()``/``init()``, an elastic
        reset) makes new communicators.
        """
        with self._lock:
            if self._failure is not None:
                return ""
            self._failure = reason
            table, collectives = self._table, self._collectives
        if collectives is not None:
            collectives.failure = reason  # ends a wait on the GPU in another thread
        if table is None or not len(table):
            return ""
        first = self._record_abort(reason)
        note = f"{self.who} aborted its NCCL communicators (ncclCommAbort)"
        note = note if first is None else f"{note}; {first}"
        if announce is not None:
            announce(note)
        logger.error("%s: aborting its NCCL communicators: %s", self.who, reason)
        table.abort()
        return note

    def _record_abort(self, reason: str) -> str | None:
        """Record this abort for the world's other ranks unless one is recorded already; returns that
        earlier one ("rank 1 on host-b aborted first: ...") or None when this one is the first."""
        mine = {"rank": self.global_rank, "who": self.who, "reason": reason}
        try:
            won = json.loads(self._store.set_if_absent(f"hora/nccl/{self._scope}/abort", json.dumps(mine).encode()))
        except Exception:  # the store may be gone with the launcher: the local reason stands
            return None
        if won.get("rank") == self.global_rank:
            return None
        return f"{won.get('who')} aborted first: {won.get('reason')}"

    def close(self, failed: bool = False) -> None:
        """Destroy every communicator, then the fusion buffer (the engine has stopped). ``failed``:
        the job failed, so communicators are aborted (a dead peer's pending work is never waited for)
        and the fusion buffer is left to the process's exit (freeing it would wait on that work).
        Work still pending at an orderly close is waited for, up to the stall limit, then aborted."""
        with self._lock:
            self._closed = True
            failed = failed or self._failure is not None
            table, collectives = self._table, self._collectives
            self._table = self._collectives = None
        if table is not None and collectives is not None and not failed:
            try:
                collectives.drain()  # ncclCommDestroy would wait for pending work without end
            except HorovodInternalError as exc:
                logger.warning("%s; aborting the NCCL communicators instead of destroying them", exc)
                failed = True
        if table is not None:
            table.close(abort=failed)
        if collectives is not None and not failed:
            collectives.close()

    @property
    def started(self) -> bool:
        return self._collectives is not None

    # ---- first use ------------------------------------------------------------------------------

    def start(self, items: Sequence[Any]) -> tuple[DeviceCollectives, CommunicatorTable]:
        """The collectives and communicator table, made on the first items' GPU; checks that every
        item is on that GPU, and makes it current in the calling thread (the engine's thread or a
        thread driving a cycle: CUDA's current device is per thread)."""
        with self._lock:
            if self._closed:
                raise HoraError(f"rank {self.global_rank}: the device path was used after hora shut down")
            if self._failure is not None:
                raise HorovodInternalError(f"{self.who}: the NCCL path was aborted ({self._failure}); "
                                           "hora.shutdown() and hora.init() form new communicators")
            collectives, table = self._collectives, self._table
            if collectives is None or table is None:  # made together, on the first use
                factory = _backend_factory or _real_backend
                cuda, nccl = factory()
                device = self._device_of(cuda, items[0])
                cuda.set_device(device)
                self._cuda, self.device = cuda, device
                limit = self._limit if self._limit is not None else stall_limit()
                collectives = self._collectives = DeviceCollectives(cuda, nccl, self._fusion_threshold, limit,
                                                                    self.who)
                table = self._table = CommunicatorTable(nccl, self._store, self._scope, self._timeout,
                                                        before_init=lambda: cuda.set_device(device))
            else:
                self._cuda.set_device(self.device)
            for item in items:
                here = self._device_of(self._cuda, item)
                if here != self.device:
                    raise HoraError(
                        f"rank {self.global_rank} on {socket.gethostname()}: tensor {item.response.name!r} is on "
                        f"cuda:{here}, but this process's NCCL collectives run on cuda:{self.device} (the "
                        "first CUDA tensor's device); hora uses one GPU per process, as Horovod does")
            return collectives, table

    @staticmethod
    def _device_of(cuda: Any, item: Any) -> int:
        buffer = item.request.buffer.buffer
        if buffer.device_id >= 0:
            return int(buffer.device_id)
        return int(cuda.pointer_device(buffer.ptr))  # __cuda_array_interface__ does not name it

    def cross_host(self, set_id: int) -> tuple[list[int], Callable[[Any], None]] | None:
        """For the global set under hierarchical allreduce across hosts: this host's ranks and the
        host-memory allreduce among the hosts' first ranks; None otherwise (flat NCCL)."""
        world = self._world
        if not self._hierarchical or set_id != 0 or world is None:
            return None
        local, cross = getattr(world, "local", None), getattr(world, "cross", None)
        if local is None or local.size == world.size or not getattr(world, "use_hierarchy", True):
            return None
        host_ranks = [int(r) for r in local.allgather_object(self.global_rank)]

        def cross_allreduce(host_buffer: Any) -> None:
            if cross is not None and cross.size > 1:
                cross.allreduce(host_buffer, ReduceOp.SUM)

        return host_ranks, cross_allreduce


class SetRunner:
    """One process set's device runner: a :class:`DeviceExecutor`, made at the set's first device
    items (the executor's ``device_runner_factory`` returns this)."""

    def __init__(self, context: DeviceContext, set_id: int, members: list[int]) -> None:
        self.context = context
        self.set_id = set_id
        self.members = members
        self._executor: DeviceExecutor | None = None

    def run(self, items: Sequence[Any], complete: Callable[[Any, Any], None]) -> None:
        collectives, table = self.context.start(items)
        executor = self._executor
        if executor is None:
            executor = self._executor = DeviceExecutor(collectives, table, self.set_id, self.members,
                                                       self.context.global_rank,
                                                       self.context.cross_host(self.set_id))
        try:
            executor.run(items, complete)
        except HorovodInternalError as exc:
            raise self._aborted(exc) from exc

    def poll(self, complete: Callable[[Any, Any], None], finish: bool = False) -> int:
        """Complete items whose GPU work is done (see :meth:`DeviceExecutor.poll`; ``finish``: wait
        for all of them, the job is shutting down); when that work cannot finish, abort every
        communicator, then raise :class:`HorovodInternalError`."""
        executor = self._executor
        if executor is None:
            return 0
        try:
            return executor.poll(complete, finish)
        except HorovodInternalError as exc:
            raise self._aborted(exc) from exc

    @property
    def waiting(self) -> bool:
        """Whether items handed to :meth:`run` still wait for the GPU before they complete."""
        return self._executor is not None and self._executor.waiting

    def _aborted(self, error: HorovodInternalError) -> HorovodInternalError:
        """Device work that cannot finish: abort the communicators now (their kernels would spin
        forever), and say so in the error."""
        note = self.context.abort(str(error))
        return HorovodInternalError(f"{error}; {note}") if note else error
