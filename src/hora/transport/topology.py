"""Where the members of a communicator run: which of them share a host.

Ranks publish a host identity (by default the kernel's boot id and network namespace, see
:func:`hora.transport.tcp_mesh.local_machine_id`) through the rendezvous store; every rank then
holds the same :class:`Topology` and derives the same host groups from it. Local and cross ranks
are therefore facts about where processes really run, not only what the launcher claimed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hora.errors import HoraError
from hora.rendezvous.client import RendezvousClient
from hora.transport.tcp_mesh import local_machine_id


@dataclass(frozen=True)
class Topology:
    """Where each member runs, as seen by the transport."""

    machines: tuple[str, ...]  # host identity per member index

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
        """(cross_rank, cross_size) as Horovod defines them: this host's index among the hosts that
        have a rank with this member's local rank."""
        local_rank, _ = self.local(member)
        peers = [g[local_rank] for g in self.hosts() if len(g) > local_rank]
        return peers.index(member), len(peers)

    @property
    def homogeneous(self) -> bool:
        """Whether every host runs the same number of members."""
        return len({len(g) for g in self.hosts()}) == 1


def exchange_topology(rank: int, members: list[int], store: RendezvousClient, scope: str,
                      timeout: float, machine: str | None = None) -> Topology:
    """Publish this member's host identity and collect everyone's (collective over ``members``).

    ``machine`` overrides the identity read from the kernel: ranks given the same label count as
    one host. That lets one machine stand in for a multi-host layout (tests, the conformance suite).
    """
    identity = local_machine_id() if machine is None else str(machine)
    store.set(f"{scope}/machine/{members[rank]}", identity.encode())
    keys = [f"{scope}/machine/{m}" for m in members]
    missing = store.wait(keys, timeout)
    if missing:
        ranks = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
        raise HoraError(f"rank {members[rank]}: ranks {ranks} never checked in within {timeout:.0f} s; "
                        "did they crash or start late? (raise HORA_START_TIMEOUT if they are just slow)")
    return Topology(tuple(store.get(k, timeout).decode() for k in keys))
