"""The response cache: steady-state steps negotiate with one bit per tensor instead of names.

Every member of a process set holds an identical cache, because entries are added, touched and
evicted only while executing responses, which every member does in the same order. A request whose
name and own signature match an entry is announced by setting that entry's bit; one bitwise-AND
allreduce per cycle then tells every member which cached tensors are ready everywhere.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict

from hora.engine.coordinator import Response
from hora.engine.request import Signature


class Lookup(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    INVALID = "invalid"  # cached under this name, but this rank now asks for something else


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._entries: OrderedDict[str, int] = OrderedDict()  # name -> bit, least recent first
        self._by_bit: list[tuple[Response, Signature] | None] = [None] * self.capacity
        self._free: list[int] = []  # freed bits below high_water, lowest reused first (a heap)
        #: One past the highest bit ever handed out. Identical on every member (the caches are), so
        #: the control vector need only carry this many bits.
        self.high_water = 0
        #: Set by the autotuner while it tries the job without the cache: none is added or used, and
        #: :meth:`suspend` empties it (every member does both at the same cycle).
        self.suspended = False

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and not self.suspended

    def lookup(self, name: str, own: Signature) -> tuple[Lookup, int]:
        bit = self._entries.get(name)
        if bit is None:
            return Lookup.MISS, -1
        entry = self._by_bit[bit]
        assert entry is not None
        return (Lookup.HIT if entry[1] == own else Lookup.INVALID), bit

    def response(self, bit: int) -> Response:
        entry = self._by_bit[bit]
        if entry is None:
            raise KeyError(f"cache bit {bit} is empty")
        return entry[0]

    def has_bit(self, bit: int, name: str) -> bool:
        entry = self._by_bit[bit] if 0 <= bit < self.capacity else None
        return entry is not None and entry[0].name == name

    def put(self, response: Response, own: Signature) -> int | None:
        """Cache (or refresh) an executed response; evicts the least recently used when full.

        Returns the bit of an entry evicted to make room, if any.
        """
        if not self.enabled or not response.cacheable:
            return None
        evicted = None
        bit = self._entries.get(response.name)
        if bit is not None:
            self._entries.move_to_end(response.name)
        else:
            if len(self._entries) >= self.capacity:
                _, bit = self._entries.popitem(last=False)
                evicted = bit
            elif self._free:
                bit = heapq.heappop(self._free)
            else:
                bit = self.high_water
                self.high_water += 1
            self._entries[response.name] = bit
        self._by_bit[bit] = (response, own)
        return evicted

    def touch(self, name: str) -> None:
        if name in self._entries:
            self._entries.move_to_end(name)

    @property
    def words(self) -> int:
        """64-bit words needed for one bit per cache entry handed out so far."""
        return (self.high_water + 63) // 64

    def evict_bit(self, bit: int) -> None:
        entry = self._by_bit[bit]
        if entry is not None:
            self._entries.pop(entry[0].name, None)
            self._by_bit[bit] = None
            heapq.heappush(self._free, bit)

    def suspend(self, suspended: bool) -> None:
        """Stop (or resume) using the cache. Suspending empties it, so that it resumes empty: a request a
        rank sent by name while the cache was off may still be negotiating when it comes back on, and
        a peer that submits the same name after that must send it by name too. An entry kept from
        before would make the peer announce it by bit instead, and the two would wait on each other."""
        if suspended and not self.suspended:
            self.clear()
        self.suspended = suspended

    def clear(self) -> None:
        self._entries.clear()
        self._by_bit = [None] * self.capacity
        self._free = []
        self.high_water = 0
