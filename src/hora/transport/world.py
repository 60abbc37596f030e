"""Form the communicator of a job: the right transport for where its ranks actually run.

Ranks publish which machine they are on (kernel boot id and network namespace) through the
rendezvous store; from that every rank derives the same topology (local and cross ranks are facts
about the connections, not just what the launcher said) and builds:
- all ranks on one host: shared memory;
- several hosts: the TCP ring, or hierarchical allreduce (shared memory inside each host, TCP across)
  when the knob asks for it or, unset, when every host runs the same number (> 1) of ranks.
"""

from __future__ import annotations

import itertools

from hora import config
from hora.errors import HoraError
from hora.rendezvous.client import RendezvousClient
from hora.transport import create_communicator
from hora.transport.base import Communicator, TransportUnavailable
from hora.transport.hierarchical import HierarchicalCommunicator
from hora.transport.topology import Topology, exchange_topology

_generation = itertools.count()

_REQUIRED = ("rank", "size", "rendezvous_addr", "rendezvous_port", "secret")


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
    choice = str(config.get("transport")).lower()
    if choice not in ("auto", "tcp", "shm"):
        raise HoraError(f"HORA_TRANSPORT={choice!r} is not a transport; use auto, tcp or shm")
    single_host = len(topology.hosts()) == 1
    if choice == "shm" and not single_host:
        raise TransportUnavailable("HORA_TRANSPORT=shm needs every rank on one host; this job spans "
                                   f"{len(topology.hosts())} hosts")
    if choice == "tcp" or len(members) == 1:
        return create_communicator("tcp", rank, members, store, scope, secret), topology
    if single_host:
        return create_communicator("shm", rank, members, store, scope, secret), topology
    if not _want_hierarchical(topology):
        return create_communicator("tcp", rank, members, store, scope, secret), topology
    return HierarchicalCommunicator.connect(rank, members, store, scope, secret, topology=topology), topology


def connect_world(transport: str | None = None, store: RendezvousClient | None = None,
                  machine: str | None = None, **options: object) -> Communicator:
    """The communicator of every rank in a job started by ``hora run`` / :func:`hora.run`.

    ``transport`` names a registered transport to use as is; None forms the world as ``init`` does.
    ``machine`` emulates this rank's host identity (see :func:`form_world`).
    Every rank must call it the same number of times: each call forms a new, separate group.
    """
    missing = [config.knob(name).env for name in _REQUIRED if config.get(name) is None]
    if missing:
        raise HoraError(
            f"this process was not started by hora: {', '.join(missing)} not set; "
            "start workers with `hora run -np N ...` or hora.run(...)"
        )
    rank, size = config.get("rank"), config.get("size")
    if not 0 <= rank < size:
        raise HoraError(f"HORA_RANK={rank} is outside a job of HORA_SIZE={size}")
    secret = config.get("secret")
    if store is None:
        store = RendezvousClient(config.get("rendezvous_addr"), config.get("rendezvous_port"), secret,
                                 connect_timeout=config.get("start_timeout"))
    scope = f"{config.get('job_id') or 'job'}/world/{next(_generation)}"
    members = list(range(size))
    if transport is None:
        return form_world(rank, members, store, scope, secret, machine)[0]
    if machine is not None:
        options["machine"] = machine
    return create_communicator(transport, rank, members, store, scope, secret, **options)
