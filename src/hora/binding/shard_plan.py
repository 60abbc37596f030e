"""Which rank owns which parameter when optimizer state is sharded (ZeRO stage 1), for every binding.

Sharded optimizers (hora.torch's ``ZeroRedundancyOptimizer`` today) need every rank to agree, without
talking, on who steps which parameter. The rule lives here, free of any framework, so a JAX or
TensorFlow binding reuses it as is:

- parameters keep the order the caller lists them in, and each rank owns one contiguous run of it,
  rank 0 the first. Contiguous runs make a rank's shard one slice of a flat buffer laid out in that
  order, so one reducescatter and one allgather per dtype move every shard, whatever the boundaries;
- a parameter is never split: its optimizer state (Adam's moments) lives whole on one rank, and a
  framework's optimizer steps it as the tensor it is;
- the runs are balanced by bytes: the largest shard is as small as any contiguous split can make it
  (that is what bounds a rank's memory), and among such splits each rank takes the run whose bytes
  come closest to an equal share of what is left, so the ranks after it are not starved or crammed;
- the plan is a pure function of the sizes and the number of ranks: identical on every rank, in
  every run, with nothing to exchange. With more ranks than parameters some ranks own nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardPlan:
    """Contiguous runs of items (parameters), one per rank: rank ``r`` owns ``bounds[r]:bounds[r + 1]``."""

    sizes: tuple[int, ...]
    bounds: tuple[int, ...]

    @property
    def ranks(self) -> int:
        return len(self.bounds) - 1

    def items(self, rank: int) -> range:
        """Positions of the items ``rank`` owns."""
        return range(self.bounds[rank], self.bounds[rank + 1])

    def owner(self, item: int) -> int:
        """The rank that owns position ``item``."""
        if not 0 <= item < len(self.sizes):
            raise IndexError(f"item {item} is not in a plan of {len(self.sizes)} items")
        # bounds repeat where a rank is empty; the rightmost bound at or below the item is its owner's
        return bisect.bisect_right(self.bounds, item) - 1

    def owners(self) -> list[int]:
        """The owning rank of every item, in item order."""
        return [r for r in range(self.ranks) for _ in self.items(r)]

    def shard_bytes(self) -> list[int]:
        """Bytes each rank owns."""
        return [sum(self.sizes[i] for i in self.items(r)) for r in range(self.ranks)]


def plan_shards(sizes: Sequence[int], ranks: int) -> ShardPlan:
    """Split items of the given byte ``sizes`` (in their fixed order) into ``ranks`` contiguous runs."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"a shard plan needs a positive number of ranks, got {ranks!r}")
    sizes = tuple(int(s) for s in sizes)
    if any(s < 0 for s in sizes):
        raise ValueError(f"item sizes must be non-negative, got {list(sizes)}")
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    cap = _smallest_cap(sizes, prefix, ranks)
    need = _runs_needed(prefix, cap)
    bounds = [0]
    start = 0
    for r in range(ranks):
        left = ranks - r  # ranks still to fill, this one included
        if left == 1:
            end = n
        else:
            remaining = prefix[n] - prefix[start]
            end = start
            while end < n:
                taken = prefix[end] - prefix[start]
                more = taken + sizes[end]
                if more > cap:
                    break
                # Stop once the rest still fits on the ranks after this one at the cap and taking the
                # next item would move this run away from an equal share (compared times ``left``,
                # in integers, so every rank decides alike).
                if need[end] <= left - 1 and abs(left * more - remaining) > abs(left * taken - remaining):
                    break
                end += 1
        bounds.append(end)
        start = end
    return ShardPlan(sizes, tuple(bounds))


def _smallest_cap(sizes: tuple[int, ...], prefix: list[int], ranks: int) -> int:
    """The smallest largest-shard (bytes) any split into ``ranks`` contiguous runs achieves."""
    low = max(sizes, default=0)
    high = prefix[-1]
    while low < high:
        middle = (low + high) // 2
        if _runs_needed(prefix, middle)[0] <= ranks:
            high = middle
        else:
            low = middle + 1
    return low


def _runs_needed(prefix: list[int], cap: int) -> list[int]:
    """``need[i]``: the fewest runs of at most ``cap`` bytes that hold items ``i:``.

    Filling each run as far as it goes is optimal for contiguous runs, and from the end backwards
    each suffix's count is one more than the suffix after its first full run. Every item must fit
    (``cap`` at least the largest item).
    """
    n = len(prefix) - 1
    need = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        j = bisect.bisect_right(prefix, prefix[i] + cap, lo=i + 1) - 1
        need[i] = 1 + need[max(j, i + 1)]
    return need


def chunk_bounds(lengths: Sequence[int], calls: int) -> list[list[tuple[int, int]]]:
    """Cut each member's run (``lengths[m]`` elements) into ``calls`` consecutive pieces, one per
    collective: ``result[k][m]`` is the element range of member m's run that collective k carries.

    Moving a shard with one collective per dtype needs flat buffers the size of the whole model for
    the length of the call, several of them at once (the packed send, the result, the transport's
    staging), which can outweigh what sharding the state saved. In pieces, a step's transient memory
    is bounded by the piece size instead. Every member cuts its run at the same multiples of one
    piece length (the longest run's share), so piece k of every member lands in collective k; a run
    shorter than the others is spent early and sends empty pieces after that.
    """
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"a run is cut into a positive number of pieces, got {calls!r}")
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"run lengths must be non-negative, got {lengths}")
    piece = -(-max(lengths, default=0) // calls)
    return [[(min(k * piece, n), min((k + 1) * piece, n)) for n in lengths] for k in range(calls)]
