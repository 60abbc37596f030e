"""Engine knobs across 2 worker processes: response cache capacity (tiny, disabled), fusion off,
HOROVOD_* aliases, and the cache's invalidation paths (same name, new signature).

One job re-initialises hora under each configuration (knobs are read at ``init``) and runs the
same battery of steps; the tests check every configuration gives the same, correct answers.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import hora

pytestmark = pytest.mark.timeout(120)

CONFIGS = {
    "default": {},
    "cache_4": {"HORA_CACHE_CAPACITY": "4"},
    "cache_off": {"HORA_CACHE_CAPACITY": "0"},
    "fusion_off": {"HORA_FUSION_THRESHOLD": "0"},
    "horovod_aliases": {"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "5",
                        "HOROVOD_CACHE_CAPACITY": "7"},
}
STEPS, TENSORS = 30, 10


def _battery(r: int, n: int) -> dict[str, Any]:
    from hora import basics

    engine = basics.engine()
    out: dict[str, Any] = {}
    s = engine.settings
    out["settings"] = (s.fusion_threshold, s.cycle_time_s, s.cache_capacity)

    # Repeated steps, opposite orders on odd ranks (more tensors than the tiny cache holds).
    names = [f"t.{i}" for i in range(TENSORS)][:: -1 if r % 2 else 1]
    wrong = 0
    rounds = engine.negotiation_rounds
    for step in range(STEPS):
        handles = {name: hora.allreduce_async(np.full(5, step + int(name[2:]) + r, np.float32), op=hora.Sum,
                                              name=name) for name in names}
        for name, h in handles.items():
            want = n * (step + int(name[2:])) + sum(range(n))
            wrong += not np.array_equal(hora.synchronize(h), np.full(5, want, np.float32))
    out["wrong"] = wrong
    out["rounds"] = engine.negotiation_rounds - rounds
    out["cache_entries"] = len(engine._sets[0].cache)

    # Same name, new signature each step (on every rank): the cached entry must be replaced.
    gathered, reduced = [], []
    for step in range(6):
        gathered.append(hora.allgather(np.full((step % 3 + r, 2), r, np.int32), name="changing.gather"))
        reduced.append(hora.allreduce(np.ones(step % 2 + 2, np.float64 if step % 3 else np.float32),
                                      op=hora.Sum, name="changing.reduce"))
    out["gathered"], out["reduced"] = gathered, reduced

    # A cached name that only rank 1 changes: a mismatch error on every rank, then recovery.
    for _ in range(3):
        hora.allreduce(np.ones(3, np.float32), op=hora.Sum, name="cached.mismatch")
    try:
        hora.allreduce(np.ones(3 + (r == 1), np.float32), op=hora.Sum, name="cached.mismatch")
        out["cached_mismatch"] = None
    except RuntimeError as exc:
        out["cached_mismatch"] = (type(exc).__name__, str(exc))
    out["after_mismatch"] = [hora.allreduce(np.ones(3, np.float32), op=hora.Sum, name="cached.mismatch")
                             for _ in range(2)]
    # Broadcast and grouped allreduce through the cache too.
    out["broadcast"] = [hora.broadcast(np.full(2, r + step, np.int64), root_rank=n - 1, name="cached.bcast")
                        for step in range(3)]
    out["grouped"] = [hora.grouped_allreduce([np.full(2, r + 1.0), np.full(3, r + 1, np.int32)], op=hora.Sum,
                                             name="cached.group") for _ in range(3)]
    return out


def _knobs_job() -> dict[str, Any]:
    for knob in ("FUSION_THRESHOLD", "CYCLE_TIME", "CACHE_CAPACITY"):  # "default" means the defaults
        for prefix in ("HORA_", "HOROVOD_"):
            os.environ.pop(prefix + knob, None)
    results = {}
    for label, env in CONFIGS.items():
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            hora.init()
            results[label] = _battery(hora.rank(), hora.size())
        finally:
            hora.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return results


@pytest.fixture(scope="module")
def knobs() -> list[dict[str, Any]]:
    return hora.run(_knobs_job, np=2)


@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_steps_are_correct_under_every_configuration_world_size_2(knobs, label):
    for res in knobs:
        battery = res[label]
        assert battery["wrong"] == 0
        for step, gathered in enumerate(battery["gathered"]):
            want = np.concatenate([np.full((step % 3 + q, 2), q, np.int32) for q in range(2)])
            np.testing.assert_array_equal(gathered, want)
        for step, reduced in enumerate(battery["reduced"]):
            assert reduced.dtype == (np.float64 if step % 3 else np.float32)
            np.testing.assert_array_equal(reduced, np.full(step % 2 + 2, 2.0))
        kind, message = battery["cached_mismatch"]
        assert kind == "CollectivePreconditionError" and "shapes" in message and "[3]" in message and "[4]" in message
        for value in battery["after_mismatch"]:
            np.testing.assert_array_equal(value, [2.0, 2.0, 2.0])
        for step, value in enumerate(battery["broadcast"]):
            np.testing.assert_array_equal(value, [1 + step] * 2)
        for floats, ints in battery["grouped"]:
            np.testing.assert_array_equal(floats, [3.0, 3.0])
            np.testing.assert_array_equal(ints, [3, 3, 3])


def test_cache_capacity_bounds_the_cache_and_zero_disables_it_world_size_2(knobs):
    for res in knobs:
        assert res["default"]["cache_entries"] == TENSORS
        assert res["default"]["rounds"] < STEPS  # steady state is served by the cache
        assert res["cache_4"]["cache_entries"] <= 4
        assert res["cache_off"]["cache_entries"] == 0
        assert res["cache_off"]["rounds"] >= STEPS  # every step negotiates by name


def test_knobs_and_horovod_aliases_reach_the_engine_world_size_2(knobs):
    for res in knobs:
        assert res["default"]["settings"] == (128 * 2**20, 0.001, 1024)
        assert res["cache_4"]["settings"][2] == 4
        assert res["fusion_off"]["settings"][0] == 0
        assert res["horovod_aliases"]["settings"] == (1024, 0.005, 7)
