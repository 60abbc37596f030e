"""Rendezvous rounds: the generations in which a job's world is formed.

A job forms its world in rounds. Each round has a generation number (0, 1, 2...), a planned size, and
optionally a plan of hosts and their slots (ranks are handed out host by host, in plan order). Every
worker that forms the round's world joins it, saying which rank it takes and on which host it runs; the
joins are the round's membership, and once every rank has joined the round is complete.

Keys that belong to a round live under :func:`round_prefix` (``round/<generation>/``). Once a newer
round is opened, a join of an older round is refused with :class:`StaleRoundError`. When a round
completes, every older round's keys are deleted and from then on any key of an older round is refused
the same way. Until then, workers still in the older round (finishing a last collective, or a group
formed by ``init(comm=...)`` that is not re-forming) keep using its keys. So a worker left behind by a
re-formed world gets a clear error instead of reading half of a dead round, and peer connections
(whose handshake carries the scope, which names the round) from an older round are refused by the
members of a newer one.

A job started by ``hora run`` forms its first world as round 0. ``shutdown()`` followed by ``init()`` in
the same process joins the next round: a driver (elastic training) opens it with a new plan, or, in a
normal job, the first worker to re-initialise opens it with the same plan as the previous round.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hora.errors import RendezvousError

ROUND_KEY_ROOT = "round/"


class StaleRoundError(RendezvousError):
    """A request named a round older than the store's current one: the world was re-formed without it."""


def round_prefix(generation: int) -> str:
    """The key prefix of one round (every key of round ``generation`` starts with it)."""
    return f"{ROUND_KEY_ROOT}{int(generation)}/"


def generation_of_key(key: str) -> int | None:
    """The round a key belongs to, or None for a key outside every round (launcher keys...)."""
    if not key.startswith(ROUND_KEY_ROOT):
        return None
    head = key[len(ROUND_KEY_ROOT):].split("/", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass(frozen=True)
class Round:
    """One round as the store knows it.

    ``hosts`` is the plan, ``(hostname, slots)`` in rank order, or empty when the round takes the ranks
    the launcher gave its workers (round 0 of a job started by ``hora run``). ``members`` is the
    membership so far: ``(rank, hostname)`` of every worker that joined, by rank. ``announcement`` is
    the id of the newest host-update announcement the round's world reflects (set by the elastic
    driver, -1 for none yet); None when the round was not opened by a driver.
    """

    generation: int
    size: int
    hosts: tuple[tuple[str, int], ...] = ()
    members: tuple[tuple[int, str], ...] = field(default=())
    announcement: int | None = None

    @property
    def complete(self) -> bool:
        """Every rank has joined."""
        return len(self.members) == self.size

    @property
    def prefix(self) -> str:
        return round_prefix(self.generation)

    def rank_for(self, hostname: str, slot: int) -> int | None:
        """The rank the plan gives slot ``slot`` (0-based) of ``hostname``; None if the plan leaves it out."""
        first = 0
        for name, slots in self.hosts:
            if name == hostname:
                return first + slot if 0 <= slot < slots else None
            first += slots
        return None

    def slots(self) -> dict[str, int]:
        """Workers per host in the membership (what actually joined), hosts in order of first rank."""
        counts: dict[str, int] = {}
        for _, hostname in self.members:
            counts[hostname] = counts.get(hostname, 0) + 1
        return counts

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "size": self.size,
                "hosts": [list(h) for h in self.hosts], "members": [list(m) for m in self.members],
                "announcement": self.announcement}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Round:
        announcement = data.get("announcement")
        return cls(int(data["generation"]), int(data["size"]),
                   tuple((str(h), int(s)) for h, s in data.get("hosts", ())),
                   tuple((int(r), str(h)) for r, h in data.get("members", ())),
                   None if announcement is None else int(announcement))

    def encode(self) -> bytes:
        return json.dumps(self.to_json()).encode()


def check_plan(size: int, hosts: tuple[tuple[str, int], ...]) -> None:
    """Refuse a plan whose slots do not add up to its size (or an empty round)."""
    if size < 1:
        raise RendezvousError(f"a rendezvous round needs at least one rank, got size {size}")
    if hosts:
        if any(slots < 1 for _, slots in hosts):
            raise RendezvousError(f"every host of a round needs at least one slot, got {list(hosts)}")
        if len({name for name, _ in hosts}) != len(hosts):
            raise RendezvousError(f"a host appears twice in the round's plan {list(hosts)}")
        if sum(slots for _, slots in hosts) != size:
            raise RendezvousError(f"the round's hosts {list(hosts)} hold "
                                  f"{sum(s for _, s in hosts)} slots, not its size {size}")


def stale_message(generation: int, current: int, what: str) -> str:
    return (f"{what} belongs to rendezvous round {generation}, but round {current} is current: the "
            "world was re-formed without this worker; call shutdown() and init() to join the current round")
