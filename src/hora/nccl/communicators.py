"""One NCCL communicator per process set, its unique id carried by hora's authenticated rendezvous.

NCCL forms a communicator from a 128-byte ``ncclUniqueId`` that one member makes and every member
passes to ``ncclCommInitRank``. The id holds the address NCCL's bootstrap listens on, so it must
reach exactly the job's ranks: it travels through the job's rendezvous store, whose connections
are authenticated with the job secret (the same store the world was formed through). The first
member of the set publishes it under a key naming the world's round, the set and an epoch; the
others wait for that key within a bounded time.

Communicators are made lazily, the first time a set runs a device collective (a CPU-only job never
touches NCCL), and destroyed when the set is removed or hora shuts down, or aborted
(``ncclCommAbort``) when a peer failed or device work stalled: an NCCL kernel whose peer is gone
spins until then. Each set's next communicator gets a new epoch, so it never reuses an old id. A
hierarchical allreduce also needs the host-local and cross-host communicators of the global set;
they are sets too, keyed by name.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from hora.errors import HoraError
from hora.nccl.library import INVALID_USAGE, NcclError

logger = logging.getLogger("hora")

#: ncclResult_t values that ``ncclCommGetAsyncError`` returns for a healthy communicator.
_NCCL_SUCCESS = 0
_NCCL_IN_PROGRESS = 7


class Store(Protocol):
    """The part of :class:`hora.rendezvous.client.RendezvousClient` used here."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, timeout: float) -> bytes: ...
    def set_if_absent(self, key: str, value: bytes) -> bytes: ...


class NcclBackend(Protocol):
    """The NCCL calls bookkeeping needs (:class:`hora.nccl.library.Nccl` has them)."""

    def unique_id(self) -> bytes: ...
    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int: ...
    def comm_destroy(self, comm: int) -> None: ...
    def comm_abort(self, comm: int) -> None: ...


@dataclass
class DeviceComm:
    """A live NCCL communicator: ``rank`` among ``size`` members of set ``key``."""

    key: Hashable
    comm: int
    rank: int
    size: int
    epoch: int


class CommunicatorTable:
    """Communicators by process set, made on first use.

    ``scope`` names the world (its rendezvous round) so that a re-formed world (elastic) never reads
    a stale id; ``timeout`` bounds the wait for the first member's id.
    """

    def __init__(self, nccl: NcclBackend, store: Store, scope: str, timeout: float = 60.0,
                 before_init: Callable[[], None] | None = None) -> None:
        self._nccl = nccl
        self._store = store
        self._scope = scope
        self._timeout = timeout
        self._before_init = before_init  # selects the CUDA device (NCCL binds the current one)
        self._comms: dict[Hashable, DeviceComm] = {}
        self._epochs: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def key_for(self, key: Hashable, epoch: int) -> str:
        return f"hora/nccl/{self._scope}/{key}/{epoch}"

    def get(self, key: Hashable, members: list[int], my_rank: int) -> DeviceComm:
        """The communicator of set ``key`` (global ranks ``members``), made on first use.

        Every member calls this at the same point of the negotiated order, so the first member's
        publish and the others' wait meet.
        """
        with self._lock:
            comm = self._comms.get(key)
            if comm is not None:
                return comm
            if my_rank not in members:
                raise HoraError(f"rank {my_rank} is not in process set {key} (members {members})")
            epoch = self._epochs.get(key, 0)
            rank = members.index(my_rank)
            store_key = self.key_for(key, epoch)
            if rank == 0:
                unique_id = self._nccl.unique_id()
                self._store.set(store_key, unique_id)
            else:
                try:
                    unique_id = self._store.get(store_key, self._timeout)
                except Exception as exc:  # re-raised with the rank and set named
                    raise HoraError(f"rank {my_rank}: no NCCL unique id for process set {key} from its first "
                                    f"member (rank {members[0]}) within {self._timeout:.0f} s: {exc}") from exc
            if self._before_init is not None:
                self._before_init()
            try:
                handle = self._nccl.comm_init_rank(len(members), unique_id, rank)
            except NcclError as exc:
                if exc.result != INVALID_USAGE:
                    raise
                raise NcclError(
                    f"rank {my_rank} on {socket.gethostname()}: NCCL refused the communicator of process set "
                    f"{key} ({exc}). The usual cause is two ranks of the set on one GPU, which NCCL does not "
                    "allow: give each rank its own GPU (torch.cuda.set_device(hvd.local_rank()), or "
                    "CUDA_VISIBLE_DEVICES), or set HORA_NCCL=off to reduce CUDA tensors through host memory",
                    exc.result) from exc
            comm = DeviceComm(key, handle, rank, len(members), epoch)
            self._comms[key] = comm
            logger.debug("rank %d: NCCL communicator for set %s (rank %d of %d)", my_rank, key, rank, len(members))
            return comm

    def release(self, key: Hashable, abort: bool = False) -> None:
        """Destroy set ``key``'s communicator (the set was removed); a later one uses a new epoch.

        ``abort``: the job failed, so a peer may be gone with work pending: ``ncclCommAbort`` returns
        without waiting for it, where ``ncclCommDestroy`` would wait for that work forever.
        """
        with self._lock:
            comm = self._comms.pop(key, None)
            if comm is None:
                return
            self._epochs[key] = comm.epoch + 1
        if abort:
            self._nccl.comm_abort(comm.comm)
        else:
            self._nccl.comm_destroy(comm.comm)

    def abort(self) -> None:
        """``ncclCommAbort`` every communicator (a peer failed or device work stalled): NCCL kernels
        still waiting for a peer that is gone end, instead of spinning forever."""
        self.close(abort=True)

    def async_error(self) -> str | None:
        """NCCL's own report of a broken communicator (``ncclCommGetAsyncError``), or None.

        NCCL reports a peer that closed its network connection this way; peers over NVLink or shared
        memory report nothing (their kernels just spin), which the caller's stall limit catches.
        Asked only where the NCCL binding offers the call.
        """
        query = getattr(self._nccl, "comm_get_async_error", None)
        if query is None:
            return None
        for comm in list(self._comms.values()):
            code = int(query(comm.comm))
            if code not in (_NCCL_SUCCESS, _NCCL_IN_PROGRESS):
                describe = getattr(self._nccl, "error_string", None)
                text = f"{describe(code)} " if describe is not None else ""
                return f"NCCL reports the communicator of process set {comm.key} broken: {text}(ncclResult_t {code})"
        return None

    def close(self, abort: bool = False) -> None:
        """Destroy (or, after a failure, abort) every communicator (shutdown)."""
        for key in list(self._comms):
            try:
                self.release(key, abort)
            except Exception as exc:  # shutdown goes on; the failure is logged
                logger.warning("destroying the NCCL communicator of set %s failed: %s", key, exc)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._comms

    def __len__(self) -> int:
        return len(self._comms)
