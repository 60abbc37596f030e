"""Hierarchical allreduce: shared memory inside each host, a ring across hosts.

With L ranks per host, local rank i reduces 1/L of the buffer over shared memory
(reduce-scatter), then the L cross-host rings (one per local rank, each carrying S/L) run in
parallel, and a shared-memory allgather puts the whole result back on every rank. Each host then
sends 2(H-1)/H x S over its network link instead of the flat ring's 2(p-1)/p x S per ring edge.
Everything that is not an allreduce goes through the flat (global) communicator.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hora.transport.base import Communicator, ReduceOp, check_buffer
from hora.transport.reduce import check_op
from hora.transport.tcp import _split


class HierarchicalCommunicator(Communicator):
    """Composes a flat communicator with per-host (local) and per-local-rank (cross) ones."""

    name = "hierarchical"
    activity = "HIERARCHICAL"

    def __init__(self, flat: Communicator, local: Communicator, cross: Communicator) -> None:
        self.flat, self.local, self.cross = flat, local, cross

    @property
    def rank(self) -> int:
        return self.flat.rank

    @property
    def size(self) -> int:
        return self.flat.size

    @property
    def global_rank(self) -> int:
        return getattr(self.flat, "global_rank", self.flat.rank)

    def allreduce(self, buf: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> None:
        check_buffer(buf)
        check_op(op, buf.dtype)
        if buf.size == 0 or self.size == 1:
            return
        flat = buf.reshape(-1)
        if self.local.size == 1:
            self.cross.allreduce(flat, op)
            return
        counts = np.diff(_split(flat.size, self.local.size)).tolist()
        part = np.empty(counts[self.local.rank], dtype=flat.dtype)
        self.local.reducescatter(flat, part, counts, op)
        if self.cross.size > 1:
            self.cross.allreduce(part, op)
        self.local.allgather(part, flat, counts)

    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        self.flat.allgather(send, recv, counts)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.flat.broadcast(buf, root)

    def alltoall(self, send, send_counts, recv, recv_counts) -> None:
        self.flat.alltoall(send, send_counts, recv, recv_counts)

    def reducescatter(self, send, recv, counts, op: ReduceOp = ReduceOp.SUM) -> None:
        self.flat.reducescatter(send, recv, counts, op)

    def barrier(self) -> None:
        self.flat.barrier()

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.flat.gather_object(obj, root)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.flat.broadcast_object(obj, root)

    def close(self) -> None:
        for comm in (self.local, self.cross, self.flat):
            comm.close()
