"""The covering worlds of the conformance suite still meet every pair of factors.

Only one transport runs the full product of cases (test_conformance.FULL_PRODUCT_TRANSPORT); every
other world runs build_cases' pairwise covering. This checks, from the case ids each world runs,
that every pair of factors of each product family occurs in every world, and that the full product
is the union of what the rotations run, so the covering drops no triple from the suite as a whole.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from conformance_cases import SMALL_SIZES, SUPPORTED_DTYPES, build_cases, dtype_name, ops_for  # noqa: E402
from test_conformance import FULL_PRODUCT_TRANSPORT, WORLDS  # noqa: E402

DTYPES = [dtype_name(d) for d in SUPPORTED_DTYPES]
SIZES = [str(s) for s in SMALL_SIZES]
OPS = {dtype_name(d): [op.name.lower() for op in ops_for(d)] for d in SUPPORTED_DTYPES}


def _ids(world_name: str) -> set[str]:
    world = WORLDS[world_name]
    return {case.id for case in build_cases(world.size, **world.knobs, covering=world.covering)}


def _reductions(ids: set[str], collective: str) -> set[tuple[str, str, str]]:
    return {(d, op, s) for d in DTYPES for op in OPS[d] for s in SIZES if f"{collective}-{d}-{op}-{s}" in ids}


def _pairs_missing(triples: set[tuple[str, ...]], full: set[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The pairs (positions a, b and their values) that occur in ``full`` but in no triple kept."""
    missing = []
    for a, b in itertools.combinations(range(3), 2):
        wanted = {(a, t[a], b, t[b]) for t in full}
        have = {(a, t[a], b, t[b]) for t in triples}
        missing += sorted(wanted - have)
    return missing


COVERING = sorted(name for name, world in WORLDS.items() if world.covering is not None)


def test_one_transport_runs_the_full_product_and_the_others_cover_it() -> None:
    full = [name for name, world in WORLDS.items() if world.covering is None]
    assert full and all(WORLDS[name].transport == FULL_PRODUCT_TRANSPORT for name in full)
    assert COVERING, "no world runs the covering"
    assert ({WORLDS[name].transport for name in COVERING}
            == {w.transport for w in WORLDS.values()} - {FULL_PRODUCT_TRANSPORT})


@pytest.mark.parametrize("name", COVERING)
def test_every_pair_of_factors_occurs_in_every_covering_world(name: str) -> None:
    world = WORLDS[name]
    ids = _ids(name)
    full_ids = {case.id for case in build_cases(world.size, **world.knobs)}
    assert ids < full_ids, "a covering world must run a strict subset of the full product"
    missing: dict[str, list[tuple[str, ...]]] = {}
    for collective in ("allreduce", "reducescatter"):
        gaps = _pairs_missing(_reductions(ids, collective), _reductions(full_ids, collective))
        if gaps:
            missing[collective] = gaps
    roots = [str(r) for r in range(world.size)]
    broadcasts = {(d, s, r) for d in DTYPES for s in SIZES for r in roots if f"broadcast-{d}-{s}-root{r}" in ids}
    every_broadcast = set(itertools.product(DTYPES, SIZES, roots))
    if gaps := _pairs_missing(broadcasts, every_broadcast):
        missing["broadcast"] = gaps
    for collective in ("allgather", "alltoall"):
        kept = {(d, s, layout) for d in DTYPES for s in SIZES for layout in ("equal", "ragged")
                if f"{collective}-{d}-{layout}-{s}" in ids}
        if gaps := _pairs_missing(kept, set(itertools.product(DTYPES, SIZES, ("equal", "ragged")))):
            missing[collective] = gaps
    assert not missing, f"{name} misses pairs: {missing}"
    # Every edge case (ids outside the product families) is kept, and one big message per collective.
    product = {i for i in full_ids
               if any(i.startswith(f"{c}-{d}-") and i.rsplit("-", 1)[-1] in SIZES + [f"root{r}" for r in roots]
                      for c in ("allreduce", "reducescatter", "broadcast", "allgather", "alltoall")
                      for d in DTYPES)}
    bigs = {i for i in full_ids if i.endswith("-big") or "-big-root" in i}
    assert (full_ids - product - bigs) <= ids
    for collective in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter"):
        assert any(i.startswith(f"{collective}-") and i in bigs for i in ids), f"{name}: no big {collective}"


def test_the_rotations_together_run_the_whole_product() -> None:
    """Over the rotations a world size gets, the covering adds up to the full product."""
    world = next(WORLDS[name] for name in COVERING if WORLDS[name].size == 3)
    union: set[str] = set()
    for k in range(12):  # the rotations repeat with period lcm(4, 2, 3) = 12 at 3 ranks
        union |= {c.id for c in build_cases(3, **world.knobs, covering=k)}
    assert union == {c.id for c in build_cases(3, **world.knobs)}
