"""Hierarchical allreduce: shared memory inside each host, rings across hosts.

Let every host run at least ``lanes`` ranks (the smallest host's count). The buffer is cut into
``lanes`` parts, identically on every rank. Inside each host, local rank i < lanes receives the
host's sum of part i (a local reduce-scatter in which local ranks >= lanes receive nothing); then
``lanes`` cross-host rings run in parallel, ring i joining local rank i of every host and carrying
part i; finally a local allgather puts the whole result back on every rank of the host.

When every host runs L ranks, lanes = L: each host sends 2(H-1)/H x S over its network link, instead
of the flat ring's 2(p-1)/p x S per ring edge. When hosts differ (say 2 + 1), lanes is smaller (1:
reduce to each host's first rank, one ring among those, share the result locally), and every part
length is still a function of the buffer size and the topology alone, so all ranks agree on it.

Everything that is not an allreduce goes through the flat (global) TCP communicator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hora import config
from hora.errors import TransportError
from hora.rendezvous.client import RendezvousClient
from hora.transport.base import Communicator, ReduceOp, check_buffer
from hora.transport.layout import split_offsets
from hora.transport.reduce import check_op
from hora.transport.scratch import ScratchArrays
from hora.transport.shm import ShmCommunicator, unavailable_reason as shm_unavailable_reason
from hora.transport.tcp import TcpCommunicator
from hora.transport.topology import Topology, exchange_topology


def unavailable_reason() -> str | None:
    """Why hierarchical allreduce cannot run here, or None when it can. Its in-host layer is the shm
    transport (TCP carries the rest), so it needs what shm needs; without it, it would be the flat
    ring under another name."""
    why = shm_unavailable_reason()
    return None if why is None else f"its in-host layer is the shm transport, which cannot run: {why}"


class HierarchicalCommunicator(Communicator):
    """Composes a flat communicator with a per-host (local) one and, on local ranks below ``lanes``
    of a job that spans hosts, a cross-host one (None otherwise)."""

    name = "hierarchical"
    activity = "HIERARCHICAL"
    can_switch_hierarchy = True

    def __init__(self, flat: Communicator, local: Communicator, cross: Communicator | None, lanes: int) -> None:
        if not 1 <= lanes <= local.size:
            raise ValueError(f"lanes must be between 1 and the local size {local.size}, got {lanes}")
        if cross is None and local.rank < lanes and local.size < flat.size:
            raise ValueError(f"local rank {local.rank} < lanes {lanes} needs its cross-host ring")
        self.flat, self.local, self.cross, self.lanes = flat, local, cross, lanes
        self._scratch = ScratchArrays()
        self._closed = False
        #: Whether allreduce goes through the hosts' layers (True) or the flat ring: the autotuner
        #: switches it, at the same engine cycle on every rank.
        self.use_hierarchy = True

    @classmethod
    def connect(
        cls,
        rank: int,
        members: Sequence[int],
        store: RendezvousClient,
        scope: str,
        secret: str | bytes,
        machine: str | None = None,
        topology: Topology | None = None,
    ) -> HierarchicalCommunicator:
        """Build the three layers for member index ``rank`` (collective over ``members``).

        ``topology`` is where members run, if already known (world formation has it); otherwise it
        is exchanged here, with ``machine`` as this rank's host identity (None: read from the kernel).
        """
        members = [int(m) for m in members]
        if topology is None:
            topology = exchange_topology(rank, members, store, f"{scope}/topology",
                                         float(config.get("start_timeout")), machine)
        hosts = topology.hosts()
        host = next(g for g in hosts if rank in g)
        local_rank = host.index(rank)
        lanes = min(len(g) for g in hosts)
        made: list[Communicator] = []
        try:
            made.append(TcpCommunicator(rank, members, store, scope, secret))
            local_kind = ShmCommunicator if len(host) > 1 else TcpCommunicator
            made.append(local_kind(local_rank, [members[m] for m in host], store, f"{scope}/local{host[0]}", secret))
            cross: Communicator | None = None
            if local_rank < lanes and len(hosts) > 1:
                ring = [g[local_rank] for g in hosts]
                cross = TcpCommunicator(ring.index(rank), [members[m] for m in ring], store,
                                        f"{scope}/cross{local_rank}", secret)
                made.append(cross)
        except BaseException:
            for comm in made:
                comm.close()
            raise
        return cls(made[0], made[1], cross, lanes)

    @property
    def rank(self) -> int:
        return self.flat.rank

    @property
    def bytes_sent(self) -> int | None:
        counts = [comm.bytes_sent for comm in (self.flat, self.local, self.cross) if comm is not None]
        return None if None in counts else sum(c for c in counts if c is not None)

    @property
    def size(self) -> int:
        return self.flat.size

    @property
    def global_rank(self) -> int:
        return self.flat.global_rank

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise TransportError(f"rank {self.global_rank}: {what} on a closed communicator")

    def allreduce(self, buf: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> None:
        self._check_open("allreduce")
        check_buffer(buf)
        check_op(op, buf.dtype)
        if buf.size == 0 or self.size == 1:
            return
        if not self.use_hierarchy:
            self.flat.allreduce(buf, op)
            return
        flat = buf.reshape(-1)
        local, cross = self.local, self.cross
        if local.size == 1:  # then this rank is its host's lane 0, and the job spans hosts
            assert cross is not None  # a lane 0 of a job that spans hosts has its cross-host ring
            cross.allreduce(flat, op)
            return
        offsets = split_offsets(flat.size, self.lanes)
        counts = [offsets[i + 1] - offsets[i] for i in range(self.lanes)] + [0] * (local.size - self.lanes)
        part = self._scratch.get("part", counts[local.rank], flat.dtype)  # reused: no fresh pages
        local.reducescatter(flat, part, counts, op)
        if cross is not None and cross.size > 1:
            cross.allreduce(part, op)
        local.allgather(part, flat, counts)

    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        self.flat.allgather(send, recv, counts)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.flat.broadcast(buf, root)

    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int]) -> None:
        self.flat.alltoall(send, send_counts, recv, recv_counts)

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                      op: ReduceOp = ReduceOp.SUM) -> None:
        self.flat.reducescatter(send, recv, counts, op)

    def barrier(self) -> None:
        self.flat.barrier()

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.flat.gather_object(obj, root)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.flat.broadcast_object(obj, root)

    def close(self) -> None:
        self._closed = True
        for comm in (self.local, self.cross, self.flat):
            if comm is not None:
                comm.close()
