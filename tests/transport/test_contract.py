"""The transport contract itself: what :class:`Communicator` declares and how transports are built.

The engine calls a transport's optional capabilities (its own memory, the staging threshold, the
timeline label) directly, so every communicator must have them, with defaults from the base class.
Transports share code only through public modules, and shared memory holds a TCP mesh for what it
cannot do in memory instead of being a TCP communicator.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import hora.transport
from hora.errors import PeerFailureError, TransportError
from hora.transport import (
    TRANSPORTS,
    Communicator,
    HierarchicalCommunicator,
    ReduceOp,
    ShmCommunicator,
    TcpCommunicator,
)

TRANSPORT_DIR = Path(hora.transport.__file__).resolve().parent


class _Minimal(Communicator):
    """Only the abstract methods: everything else comes from the base class."""

    name = "minimal"

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def allreduce(self, buf: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> None: ...
    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None: ...
    def broadcast(self, buf: np.ndarray, root: int) -> None: ...
    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int]) -> None: ...
    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                      op: ReduceOp = ReduceOp.SUM) -> None: ...
    def barrier(self) -> None: ...
    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return [obj]
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj
    def close(self) -> None: ...


def test_a_transport_that_declares_no_capabilities_gets_the_base_defaults() -> None:
    comm = _Minimal()
    assert comm.activity == "RING"
    assert comm.allocates_own_memory is False
    assert comm.staged_min_bytes == 0
    buf = comm.allocate(24)
    assert buf.dtype == np.uint8 and buf.shape == (24,)
    assert comm.global_rank == comm.rank == 0


def test_built_in_transports_declare_their_capabilities_as_class_attributes() -> None:
    assert ShmCommunicator.allocates_own_memory is True
    assert ShmCommunicator.staged_min_bytes > 0
    assert ShmCommunicator.activity == "SHM"
    assert TcpCommunicator.allocates_own_memory is False
    assert HierarchicalCommunicator.activity == "HIERARCHICAL"
    assert set(TRANSPORTS) >= {"tcp", "shm", "hierarchical"}


def test_peer_failure_says_whether_the_peer_timed_out_or_was_seen_to_fail() -> None:
    died = PeerFailureError("rank 2 closed its connection", 2)
    hung = PeerFailureError("no data from rank 2 for 30 s", 2, timed_out=True)
    assert died.timed_out is False and died.failed_rank == 2
    assert hung.timed_out is True and hung.failed_rank == 2
    assert isinstance(hung, TransportError)


def test_shared_memory_holds_a_tcp_mesh_instead_of_being_a_tcp_communicator() -> None:
    assert not issubclass(ShmCommunicator, TcpCommunicator)
    assert issubclass(ShmCommunicator, Communicator)


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hora"):
            found += [f"{path.name}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_transport_module_imports_private_names_of_another_module() -> None:
    offenders = [line for path in sorted(TRANSPORT_DIR.glob("*.py")) for line in _private_imports(path)]
    assert not offenders, "\n".join(offenders)
