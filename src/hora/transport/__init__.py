"""Collectives on contiguous buffers between a fixed set of processes.

``TRANSPORTS`` is the registry: a new transport is a module with a :class:`Communicator` subclass
(or a factory that builds one from the same arguments) and one line here (a second in
``REQUIREMENTS`` when it needs more of the machine than sockets), and is then picked up by the
conformance suite in tests/transport/ and reported by ``hora check``. Every factory takes ``(rank,
members, store, scope, secret, **options)``: this process's index in ``members`` (global ranks), the
rendezvous store the members find each other through, a scope unique to this communicator, and the
job secret.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hora.rendezvous.client import RendezvousClient
from hora.transport import hierarchical, mpi, shm
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

TRANSPORTS: dict[str, Callable[..., Communicator]] = {
    "tcp": TcpCommunicator,
    "shm": ShmCommunicator,
    "hierarchical": HierarchicalCommunicator.connect,
    "mpi": MpiCommunicator,  # mpi4py; needs a job formed over MPI (mpirun, init(comm=...))
}

#: What a transport needs from this machine beyond Python and sockets: a function saying why it cannot
#: run here (None: it can). A transport not listed needs nothing more (tcp).
REQUIREMENTS: dict[str, Callable[[], str | None]] = {
    "shm": shm.unavailable_reason,
    "hierarchical": hierarchical.unavailable_reason,
    "mpi": mpi.unavailable_reason,
}


def unavailable_reason(name: str) -> str | None:
    """Why transport ``name`` cannot run on this machine, or None when it can.

    Asked before anything starts (``hora check``, ``hora run --mpi``): a missing requirement is then one
    line from the launcher, not the same traceback from every rank once they run. What depends on the
    job rather than the machine (shm needs every rank on one host, mpi a job formed over MPI) is
    checked when a job forms.
    """
    if name not in TRANSPORTS:
        return f"unknown transport {name!r}; available: {', '.join(sorted(TRANSPORTS))}"
    check = REQUIREMENTS.get(name)
    return None if check is None else check()


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
    "REQUIREMENTS",
    "TRANSPORTS",
    "Communicator",
    "HierarchicalCommunicator",
    "ReduceOp",
    "ShmCommunicator",
    "TcpCommunicator",
    "TransportUnavailable",
    "create_communicator",
    "unavailable_reason",
]
