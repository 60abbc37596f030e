"""Form the communicator of a job: the right transport for where its ranks actually run.

Ranks publish which machine they are on through the rendezvous store (see
:mod:`hora.transport.topology`); from that every rank derives the same topology (local and cross
ranks are facts about the connections, not just what the launcher said) and builds:
- all ranks on one host: shared memory;
- several hosts: the TCP ring, or hierarchical allreduce (shared memory inside each host, TCP across)
  when the knob asks for it (hosts may run different numbers of ranks) or, unset, when every host
  runs the same number (> 1) of ranks.
Process sets get the same choice for their own ranks (:func:`connect_group`).
"""

from __future__ import annotations

from hora import config
from hora.errors import HoraError
from hora.rendezvous.client import RendezvousClient
from hora.transport import create_communicator
from hora.transport.base import Communicator, TransportUnavailable
from hora.transport.hierarchical import HierarchicalCommunicator
from hora.transport.topology import Topology, exchange_topology


def _want_hierarchical(topology: Topology) -> bool:
    hosts = topology.hosts()
    if len(hosts) == 1:
        return False
    if config.is_set("hierarchical_allreduce"):
        return bool(config.get("hierarchical_allreduce"))
    return topology.homogeneous and len(hosts[0]) > 1


def form_world(rank: int, members: list[int], store: RendezvousClient, scope: str,
               secret: str | bytes, machine: str | None = None) -> tuple[Communicator, Topology]:
    """Every member calls this with the same arguments (but its own ``rank`` index).

    ``machine`` is this rank's host identity; None reads it from the kernel. Ranks given the same
    label are treated as one host, so one machine can stand in for a multi-host layout.
    """
    timeout = float(config.get("start_timeout"))
    topology = exchange_topology(rank, members, store, scope, timeout, machine)
    return connect_group(rank, members, store, scope, secret, topology), topology


def connect_group(rank: int, members: list[int], store: RendezvousClient, scope: str,
                  secret: str | bytes, topology: Topology) -> Communicator:
    """The communicator of ``members`` whose hosts ``topology`` already gives (indexed like
    ``members``): the transport :func:`form_world` would choose for them. Process sets use it, so a
    set gets the same transport a world of its ranks would."""
    choice = str(config.get("transport")).lower()
    if choice not in ("auto", "tcp", "shm", "mpi"):
        raise HoraError(f"HORA_TRANSPORT={choice!r} is not a transport; use auto, tcp, shm or mpi")
    if choice == "mpi":
        return create_communicator("mpi", rank, members, store, scope, secret)
    single_host = len(topology.hosts()) == 1
    if choice == "shm" and not single_host:
        raise TransportUnavailable("HORA_TRANSPORT=shm needs every rank on one host; this job spans "
                                   f"{len(topology.hosts())} hosts")
    if choice == "tcp" or len(members) == 1:
        return create_communicator("tcp", rank, members, store, scope, secret)
    if single_host:
        return create_communicator("shm", rank, members, store, scope, secret)
    if not _want_hierarchical(topology):
        return create_communicator("tcp", rank, members, store, scope, secret)
    return HierarchicalCommunicator.connect(rank, members, store, scope, secret, topology=topology)
