"""Which hosts an elastic job may use, and how its world is laid out on them.

The driver feeds every discovery answer to a :class:`HostRegistry` and blacklists the host of every
worker that fails. Without a cooldown range a blacklisted host is out for the rest of the job. With
``--blacklist-cooldown-range LO HI``, the host's n-th failure keeps it out for ``LO * 2**(n-1)``
seconds, at most ``HI``, plus up to one second of jitter so hosts that failed together do not come
back together. A flaky host thus waits longer each time, and a host that recovered is used again.
A host missing from discovery answers counts as removed only after ``removal_grace`` seconds (a
blacklisted one at once: it failed, then vanished).

:func:`plan_world` turns the usable hosts into the next round's plan. Hosts of the current world
come first, in their current order, then new hosts in discovery order, and the total is capped at
``max_np``. Ranks are handed out host by host in plan order, so a surviving worker keeps its rank
whenever no host before it lost slots, and rank 0 (which shares its state with newcomers) stays on
a surviving host.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hora.runner.elastic.discovery import HostSlots
from hora.workers.hosts import Host, SlotInfo, assign_slots

logger = logging.getLogger(__name__)

Plan = tuple[tuple[str, int], ...]

# The cooldown (seconds after a host's first failure, and at most) of jobs whose hosts a cluster
# manager provides (Ray, Spark): it removes dead machines itself, so a live one whose worker failed
# deserves another try, later each time.
CLUSTER_COOLDOWN_RANGE = (10.0, 300.0)


@dataclass
class _Blacklisting:
    failures: int
    until: float | None  # monotonic time it may return; None: never


class HostRegistry:
    """The discovered hosts minus the blacklisted ones."""

    def __init__(self, cooldown_range: Sequence[float] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 jitter: Callable[[], float] = random.random,
                 removal_grace: float = 0.0) -> None:
        if cooldown_range is not None:
            low, high = (float(v) for v in cooldown_range)
            if low < 0 or high < low:
                raise ValueError(f"the blacklist cooldown range needs 0 <= MIN <= MAX, got {low:g} {high:g}")
            cooldown_range = (low, high)
        self._cooldown = cooldown_range
        self._clock = clock
        self._jitter = jitter
        self._discovered: HostSlots = {}
        self._blacklist: dict[str, _Blacklisting] = {}
        self._removal_grace = float(removal_grace)
        self._missing_since: dict[str, tuple[float, int]] = {}  # host -> (first missed, last slots)

    def update(self, discovered: HostSlots) -> None:
        """Take a discovery answer. A host that vanishes from it stays for ``removal_grace`` seconds
        (with its last slots) before it counts as gone, so one flaky answer, or a host that drops out
        of a cloud listing for a moment, does not cost two resets."""
        now = self._clock()
        previous = self._discovered
        merged = dict(discovered)
        for host, slots in previous.items():
            if host in discovered:
                self._missing_since.pop(host, None)
                continue
            if host in self._blacklist:
                # A host that failed and then vanished is gone: the grace is for healthy hosts that
                # drop out of one answer, and must not bring a dead one back when its cooldown ends.
                self._missing_since.pop(host, None)
                continue
            since, _ = self._missing_since.setdefault(host, (now, slots))
            if now - since < self._removal_grace:
                merged[host] = self._missing_since[host][1]
            else:
                self._missing_since.pop(host, None)
        for host in list(self._missing_since):
            if host in discovered:
                del self._missing_since[host]
        self._discovered = merged

    @property
    def discovered(self) -> HostSlots:
        return dict(self._discovered)

    def blacklist(self, host: str) -> float | None:
        """Keep ``host`` out after a failure; returns the seconds it stays out (None: for good)."""
        entry = self._blacklist.get(host)
        failures = 1 if entry is None else entry.failures + 1
        if self._cooldown is None:
            self._blacklist[host] = _Blacklisting(failures, None)
            return None
        low, high = self._cooldown
        delay = min(high, low * 2 ** (failures - 1)) + self._jitter()
        self._blacklist[host] = _Blacklisting(failures, self._clock() + delay)
        return delay

    def is_blacklisted(self, host: str) -> bool:
        entry = self._blacklist.get(host)
        return entry is not None and (entry.until is None or self._clock() < entry.until)

    def cooling_down(self) -> bool:
        """Whether some blacklisted host may come back later."""
        now = self._clock()
        return any(e.until is not None and now < e.until for e in self._blacklist.values())

    def usable(self) -> HostSlots:
        """Discovered hosts that are not blacklisted now, in discovery order."""
        return {host: slots for host, slots in self._discovered.items() if not self.is_blacklisted(host)}


def plan_world(usable: HostSlots, current: Plan, max_np: int | None) -> Plan:
    """The next round's hosts and slots: current hosts first (in order), then new ones, capped at max_np."""
    ordered = [(host, usable[host]) for host, _ in current if host in usable]
    ordered += [(host, slots) for host, slots in usable.items() if host not in dict(current)]
    plan: list[tuple[str, int]] = []
    room = max_np if max_np is not None else sum(slots for _, slots in ordered)
    for host, slots in ordered:
        if room <= 0:
            break
        take = min(slots, room)
        plan.append((host, take))
        room -= take
    return tuple(plan)


def plan_size(plan: Plan) -> int:
    return sum(slots for _, slots in plan)


def plan_slots(plan: Plan) -> list[SlotInfo]:
    """Every rank's coordinates under ``plan`` (what a worker started for it is told)."""
    return assign_slots([Host(host, slots) for host, slots in plan], plan_size(plan))


def describe_plan(plan: Plan) -> str:
    return ",".join(f"{host}:{slots}" for host, slots in plan) or "no hosts"
