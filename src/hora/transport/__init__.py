"""Collectives on contiguous buffers between a fixed set of processes.

``TRANSPORTS`` is the registry: a new transport is a module with a :class:`Communicator` subclass
(or a factory that builds one from the same arguments) and one line here, and is then picked up by
the conformance suite in tests/transport/. Every factory takes ``(rank, members, store, scope,
secret, **options)``: this process's index in ``members`` (global ranks), the rendezvous store the
members find each other through, a scope unique to this communicator, and the job secret.
"""

from __future__ import annotations

from typing import Callable, Sequence

from hora.transport.base import (
    SUPPORTED_DTYPES,
    Communicator,
    ReduceOp,
    TransportUnavailable,
)
from hora.transport.hierarchical import HierarchicalCommunicator
from hora.transport.mpi import MpiCommunicator
from hora.transport.shm import ShmCommunicator
from hora.transport.tcp import TcpCommunicator
from hora.rendezvous.client import RendezvousClient

TRANSPORTS: dict[str, Callable[..., Communicator]] = {
    "tcp": TcpCommunicator,
    "shm": ShmCommunicator,
    "hierarchical": HierarchicalCommunicator.connect,
    "mpi": MpiCommunicator,  # mpi4py; needs a job formed over MPI (mpirun, init(comm=...))
}


def create_communicator(
    name: str,
    rank: int,
    members: Sequence[int],
    store: RendezvousClient,
    scope: str,
    secret: str | bytes,
    **options: object,
) -> Communicator:
    """Build the named transport's communicator; every member must call this with the same scope."""
    try:
        factory = TRANSPORTS[name]
    except KeyError:
        raise TransportUnavailable(
            f"unknown transport {name!r}; available: {', '.join(sorted(TRANSPORTS))}"
        ) from None
    return factory(rank, members, store, scope, secret, **options)


__all__ = [
    "SUPPORTED_DTYPES",
    "TRANSPORTS",
    "Communicator",
    "HierarchicalCommunicator",
    "ReduceOp",
    "ShmCommunicator",
    "TcpCommunicator",
    "TransportUnavailable",
    "create_communicator",
]
