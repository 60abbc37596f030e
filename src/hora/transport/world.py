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
from dataclasses import dataclass

from hora import config
from hora.errors import HoraError
from hora.rendezvous.client import RendezvousClient
from hora.transport import create_communicator
from hora.transport.base import Communicator, TransportUnavailable
from hora.transport.hierarchical import HierarchicalCommunicator
from hora.transport.tcp_mesh import local_machine_id

_generation = itertools.count()

_REQUIRED = ("rank", "size", "rendezvous_addr", "rendezvous_port", "secret")


@dataclass(frozen=True)
class Topology:
    """Where each member runs, as seen by the transport."""

    machines: tuple[str, ...]  # per member index

    def hosts(self) -> list[list[int]]:
        """Member indices grouped by host, hosts in order of their first member."""
        order: dict[str, list[int]] = {}
        for member, machine in enumerate(self.machines):
            order.setdefault(machine, []).append(member)
        return list(order.values())

    def local(self, member: int) -> tuple[int, int]:
        """(local_rank, local_size) of ``member``."""
        group = next(g for g in self.hosts() if member in g)
        return group.index(member), len(group)

    def cross(self, member: int) -> tuple[int, int]:
        """(cross_rank, cross_size): this host's index among hosts that have this local rank."""
        local_rank, _ = self.local(member)
        peers = [g[local_rank] for g in self.hosts() if len(g) > local_rank]
        return peers.index(member), len(peers)

    @property
    def homogeneous(self) -> bool:
        return len({len(g) for g in self.hosts()}) == 1


def exchange_topology(rank: int, members: list[int], store: RendezvousClient, scope: str,
                      timeout: float) -> Topology:
    store.set(f"{scope}/machine/{members[rank]}", local_machine_id().encode())
    keys = [f"{scope}/machine/{m}" for m in members]
    missing = store.wait(keys, timeout)
    if missing:
        ranks = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
        raise HoraError(f"rank {members[rank]}: ranks {ranks} never checked in within {timeout:.0f} s; "
                        "did they crash or start late? (raise HORA_START_TIMEOUT if they are just slow)")
    return Topology(tuple(store.get(k, timeout).decode() for k in keys))


def _want_hierarchical(topology: Topology) -> bool:
    hosts = topology.hosts()
    if len(hosts) == 1:
        return False
    if config.is_set("hierarchical_allreduce"):
        return bool(config.get("hierarchical_allreduce"))
    return topology.homogeneous and len(hosts[0]) > 1


def form_world(rank: int, members: list[int], store: RendezvousClient, scope: str,
               secret: str | bytes) -> tuple[Communicator, Topology]:
    """Every member calls this with the same arguments (but its own ``rank`` index)."""
    timeout = float(config.get("start_timeout"))
    topology = exchange_topology(rank, members, store, scope, timeout)
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
    flat = create_communicator("tcp", rank, members, store, scope, secret)
    if not _want_hierarchical(topology):
        return flat, topology
    local_rank, _ = topology.local(rank)
    host = next(g for g in topology.hosts() if rank in g)
    cross_group = [g[local_rank] for g in topology.hosts() if len(g) > local_rank]
    local = create_communicator("shm" if len(host) > 1 else "tcp", host.index(rank),
                                [members[m] for m in host], store, f"{scope}/local{host[0]}", secret)
    cross = create_communicator("tcp", cross_group.index(rank), [members[m] for m in cross_group],
                                store, f"{scope}/cross{local_rank}", secret)
    return HierarchicalCommunicator(flat, local, cross), topology


def connect_world(transport: str | None = None, store: RendezvousClient | None = None,
                  **options: object) -> Communicator:
    """The communicator of every rank in a job started by ``hora run`` / :func:`hora.run`.

    ``transport`` names a registered transport to use as is; None forms the world as ``init`` does.
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
        return form_world(rank, members, store, scope, secret)[0]
    return create_communicator(transport, rank, members, store, scope, secret, **options)
