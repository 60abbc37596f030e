"""hora.binding.shard_plan: which rank owns which parameter when optimizer state is sharded. No processes.

The plan must be contiguous, cover every parameter exactly once, keep each whole, make the largest
shard as small as any contiguous split can (checked against every split of small random cases), and
be a pure function of the sizes and the rank count, so that every rank computes the same one.
"""

from __future__ import annotations

import itertools
import random

import pytest

from hora.binding.shard_plan import ShardPlan, chunk_bounds, plan_shards


def best_max_shard(sizes: list[int], ranks: int) -> int:
    """The smallest largest shard over every split into ``ranks`` contiguous runs (brute force)."""
    n = len(sizes)
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), ranks - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(sizes[bounds[r]:bounds[r + 1]]) for r in range(ranks))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def check_well_formed(plan: ShardPlan, sizes: list[int], ranks: int) -> None:
    assert plan.ranks == ranks
    assert plan.bounds[0] == 0 and plan.bounds[-1] == len(sizes)
    assert list(plan.bounds) == sorted(plan.bounds)  # contiguous runs in order
    assert [i for r in range(ranks) for i in plan.items(r)] == list(range(len(sizes)))  # each item once
    assert plan.owners() == [plan.owner(i) for i in range(len(sizes))]
    assert sum(plan.shard_bytes()) == sum(sizes)


def test_equal_parameters_split_evenly() -> None:
    assert plan_shards([4] * 6, 3).bounds == (0, 2, 4, 6)
    assert plan_shards([4] * 6, 2).bounds == (0, 3, 6)
    assert plan_shards([4] * 4, 3).shard_bytes() == [4, 8, 4]  # uneven world: one rank takes two


def test_a_large_parameter_is_never_split() -> None:
    plan = plan_shards([1, 1, 100, 1, 1], 3)
    assert plan.shard_bytes() == [2, 100, 2]
    assert plan.owner(2) == 1


def test_more_ranks_than_parameters() -> None:
    plan = plan_shards([8, 8], 5)
    check_well_formed(plan, [8, 8], 5)
    assert sorted(plan.shard_bytes()) == [0, 0, 0, 8, 8]
    assert plan_shards([], 3).bounds == (0, 0, 0, 0)
    assert plan_shards([10], 3).shard_bytes().count(10) == 1


def test_one_rank_owns_everything() -> None:
    plan = plan_shards([3, 5, 7], 1)
    assert plan.bounds == (0, 3) and plan.owners() == [0, 0, 0]


def test_zero_sized_parameters_are_owned_too() -> None:
    plan = plan_shards([0, 4, 0, 4, 0], 2)
    check_well_formed(plan, [0, 4, 0, 4, 0], 2)
    assert plan.shard_bytes() == [4, 4]


@pytest.mark.parametrize("seed", range(40))
def test_largest_shard_is_the_smallest_possible(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, 64), rng.randint(1, 4096)]) for _ in range(rng.randint(1, 9))]
    ranks = rng.randint(1, 5)
    plan = plan_shards(sizes, ranks)
    check_well_formed(plan, sizes, ranks)
    assert max(plan.shard_bytes()) == best_max_shard(sizes, ranks)


def test_the_plan_is_a_pure_function_of_sizes_and_ranks() -> None:
    rng = random.Random(7)
    sizes = [rng.randint(1, 1 << 20) for _ in range(500)]
    plans = {plan_shards(sizes, 7) for _ in range(3)}  # frozen dataclasses: equal plans hash alike
    assert len(plans) == 1
    plan = plans.pop()
    assert plan == plan_shards(tuple(sizes), 7)
    # balanced: no shard above the mean plus the largest parameter
    assert max(plan.shard_bytes()) <= sum(sizes) / 7 + max(sizes)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positive number of ranks"):
        plan_shards([1, 2], 0)
    with pytest.raises(ValueError, match="positive number of ranks"):
        plan_shards([1, 2], True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        plan_shards([1, -2], 2)
    with pytest.raises(IndexError):
        plan_shards([1, 2], 2).owner(2)


# ---- pieces: a run moved in several collectives ---------------------------------------------------


def test_pieces_tile_every_run_and_line_up_across_members() -> None:
    lengths = [10, 3, 0, 7]
    calls = chunk_bounds(lengths, 4)
    assert len(calls) == 4 and all(len(call) == len(lengths) for call in calls)
    for member, n in enumerate(lengths):
        ranges = [call[member] for call in calls]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a <= b for a, b in ranges)
        assert all(ranges[k][1] == ranges[k + 1][0] for k in range(len(ranges) - 1))  # contiguous, in order
    # one piece length for everyone (the longest run's share), so piece k starts at the same offset
    assert [call[0] for call in calls] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [call[1] for call in calls] == [(0, 3), (3, 3), (3, 3), (3, 3)]
    assert all(call[2] == (0, 0) for call in calls)


@pytest.mark.parametrize("seed", range(20))
def test_no_piece_is_longer_than_the_longest_runs_share(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randrange(0, 50) for _ in range(rng.randrange(1, 5))]
    calls_wanted = rng.randrange(1, 8)
    calls = chunk_bounds(lengths, calls_wanted)
    share = -(-max(lengths) // calls_wanted)
    assert len(calls) == calls_wanted
    assert all(b - a <= share for call in calls for a, b in call)
    assert [sum(call[m][1] - call[m][0] for call in calls) for m in range(len(lengths))] == lengths


def test_chunk_bounds_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positive number of pieces"):
        chunk_bounds([4], 0)
    with pytest.raises(ValueError, match="non-negative"):
        chunk_bounds([4, -1], 2)
    assert chunk_bounds([], 2) == [[], []]
