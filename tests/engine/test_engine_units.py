"""Engine pieces without processes: coordinator, response cache, fusion planning, timeline file."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest

from hora.engine.cache import Lookup, ResponseCache
from hora.engine.coordinator import Coordinator, Response
from hora.engine.executor import Item, plan_buckets, reducescatter_rows
from hora.engine.request import Kind, Signature, process_set_signature, signature
from hora.engine.timeline import Timeline
from hora.transport.base import ReduceOp

pytestmark = pytest.mark.timeout(30)


def ar(shape=(4,), dtype="float32", **fields) -> Signature:
    return Signature(Kind.ALLREDUCE, dtype, tuple(shape), **fields)


JOIN = Signature(Kind.JOIN, "uint8", ())


# ---- Coordinator: readiness -------------------------------------------------------------------


def test_coordinator_releases_a_name_only_when_every_member_submitted_it():
    c = Coordinator([0, 1, 2])
    c.submit(0, [("a", ar())])
    c.submit(2, [("a", ar())])
    assert c.ready() == []
    assert c.is_pending("a") and c.has_pending
    c.submit(1, [("a", ar())])
    [response] = c.ready()
    assert response.name == "a" and response.error is None and response.joined == ()
    assert not c.has_pending and c.ready() == []


def test_coordinator_orders_responses_by_first_sighting():
    c = Coordinator([0, 1])
    c.submit(0, [("b", ar()), ("a", ar()), ("c", ar())])
    c.submit(1, [("c", ar()), ("a", ar()), ("b", ar())])
    assert [r.name for r in c.ready()] == ["b", "a", "c"]


def test_coordinator_does_not_wait_for_joined_ranks_and_reports_them():
    c = Coordinator([0, 1, 2])
    c.submit(2, [("join.0", JOIN)])
    assert c.joined == (2,)
    c.submit(0, [("a", ar())])
    assert c.ready() == []  # member 1 is neither ready nor joined
    c.submit(1, [("a", ar())])
    [response] = c.ready()
    assert response.name == "a" and response.error is None and response.joined == (2,)
    assert not response.cacheable  # a joined rank's zeros must not be replayed from the cache


def test_coordinator_join_completes_when_all_joined_naming_the_last():
    c = Coordinator([0, 1, 2])
    c.submit(1, [("j", JOIN)])
    c.submit(0, [("j", JOIN)])
    assert c.ready() == []
    c.submit(2, [("j", JOIN)])
    [response] = c.ready()
    assert response.signature.kind == Kind.JOIN and response.last_joined == 2
    assert c.joined == ()  # the next epoch starts with nobody joined


def test_coordinator_rejects_non_allreduce_while_ranks_have_joined():
    c = Coordinator([0, 1])
    c.submit(1, [("j", JOIN)])
    c.submit(0, [("g", Signature(Kind.ALLGATHER, "float32", (2,)))])
    [response] = c.ready()
    assert response.error is not None and "join" in response.error and "[1]" in response.error


def test_coordinator_waits_for_a_joined_rank_on_a_collective_that_runs_through_join():
    # Sharded optimizers: a rank out of data still steps its shard, so their collectives wait for it
    # and take its data, reducescatter and allgather included, while plain allreduces count it as zeros.
    c = Coordinator([0, 1, 2])
    c.submit(2, [("j", JOIN)])
    through = Signature(Kind.REDUCESCATTER, "float32", (6,), through_join=True)
    c.submit(0, [("rs", through), ("plain", ar())])
    c.submit(1, [("rs", through), ("plain", ar())])
    [plain] = c.ready()
    assert plain.name == "plain" and plain.joined == (2,)
    report = c.stalls(now=1e9, warn_after=1.0, fail_after=0.0)
    assert any("'rs'" in w and "[2]" in w for w in report.warnings), report.warnings
    c.submit(2, [("rs", through)])
    [rs] = c.ready()
    assert rs.error is None and rs.joined == () and rs.cacheable


def test_a_collective_only_joined_ranks_have_submitted_is_not_a_stall():
    # A joined rank's join probe waits for the others' next step as long as they train (evaluating,
    # checkpointing): as a joined rank waits in join(), it is not reported, nor fatal.
    c = Coordinator([0, 1, 2])
    c.submit(2, [("j", JOIN), ("probe", ar(through_join=True))])
    c.ready()
    report = c.stalls(now=1e9, warn_after=1.0, fail_after=2.0)
    assert report.warnings == [] and report.fatal is None
    c.submit(0, [("probe", ar(through_join=True))])  # a training rank's step began: now it is one
    report = c.stalls(now=2e9, warn_after=1.0, fail_after=2.0)
    assert report.fatal is not None and "[1]" in report.fatal


def test_coordinator_names_ranks_that_disagree_on_running_through_join():
    c = Coordinator([0, 1])
    c.submit(0, [("a", ar(through_join=True))])
    c.submit(1, [("a", ar())])
    [response] = c.ready()
    assert response.error is not None and "join participation" in response.error, response.error


def test_through_join_travels_in_the_interned_signature():
    import pickle

    sig = signature(Kind.ALLGATHER, "float32", (3, 2), through_join=True)
    assert sig is signature(Kind.ALLGATHER, "float32", (3, 2), through_join=True)
    assert sig != signature(Kind.ALLGATHER, "float32", (3, 2))
    assert pickle.loads(pickle.dumps(sig)) is sig


def test_coordinator_releases_a_group_only_when_complete():
    c = Coordinator([0, 1])
    g = dict(group="grp", group_size=3)
    for member in (0, 1):
        c.submit(member, [("grp.0", ar(**g)), ("grp.1", ar(**g))])
    c.submit(0, [("solo", ar())])
    c.submit(1, [("solo", ar())])
    assert [r.name for r in c.ready()] == ["solo"]  # the group waits for its third member
    c.submit(0, [("grp.2", ar(**g))])
    assert c.ready() == []  # ... on every member
    c.submit(1, [("grp.2", ar(**g))])
    assert [r.name for r in c.ready()] == ["grp.0", "grp.1", "grp.2"]


# ---- Coordinator: disagreement -----------------------------------------------------------------


MISMATCHES = {
    "shapes": (ar((3,)), ar((4,)), ["[3]", "[4]"]),
    "data types": (ar(dtype="float32"), ar(dtype="int32"), ["float32", "int32"]),
    "reduce ops": (ar(op="sum"), ar(op="max"), ["sum", "max"]),
    "root ranks": (
        Signature(Kind.BROADCAST, "float32", (2,), root=5),
        Signature(Kind.BROADCAST, "float32", (2,), root=7),
        ["5", "7"],
    ),
    "prescale factors": (ar(prescale=1.0), ar(prescale=2.0), ["1.0", "2.0"]),
    "postscale factors": (ar(postscale=0.5), ar(postscale=0.25), ["0.5", "0.25"]),
    "operations": (ar(), Signature(Kind.BROADCAST, "float32", (4,), root=5), ["ALLREDUCE", "BROADCAST"]),
    "rank lists": (process_set_signature(ranks=(0, 1)), process_set_signature(ranks=(0, 2)), ["[0, 1]", "[0, 2]"]),
    "process set ids": (process_set_signature(set_id=3), process_set_signature(set_id=4), ["3", "4"]),
}


def test_process_set_changes_carry_their_own_fields_and_are_never_cached():
    add = process_set_signature(ranks=(0, 2))
    remove = process_set_signature(set_id=2)
    assert (add.kind, add.set_ranks, add.splits, add.op) == (Kind.ADD_PROCESS_SET, (0, 2), (), ReduceOp.SUM)
    assert (remove.kind, remove.set_id, remove.root) == (Kind.REMOVE_PROCESS_SET, 2, -1)
    assert add != process_set_signature(ranks=(0, 1)) and remove != process_set_signature(set_id=3)
    c = Coordinator([0, 1])
    c.submit(0, [("ps", add)])
    c.submit(1, [("ps", process_set_signature(ranks=(0, 2)))])
    [response] = c.ready()
    assert response.error is None and not response.cacheable and response.fusion_key is None


def test_signatures_and_responses_pickle_as_their_fields_and_come_back_interned():
    import pickle

    sig = signature(Kind.ALLREDUCE, "float16", (4, 5), ReduceOp.MAX, prescale=0.5, postscale=2.0, group="g",
                    group_size=3, device="cuda")
    # Touch the cached properties so that they are filled in before pickling: they must not travel.
    _ = sig.count, sig.np_dtype, sig._key
    back = pickle.loads(pickle.dumps(sig, protocol=pickle.HIGHEST_PROTOCOL))
    assert back is sig
    a2a = signature(Kind.ALLTOALL, "int64", (6, 2), root=-1, splits=(2, 4))
    assert pickle.loads(pickle.dumps(a2a)) is a2a
    for ps in (process_set_signature(ranks=(0, 2)), process_set_signature(set_id=3)):
        got = pickle.loads(pickle.dumps(ps))
        assert got == ps and (got.set_ranks, got.set_id) == (ps.set_ranks, ps.set_id)
    response = Response("t", sig, error="boom", rows=(1, 2), splits=((1,), (2,)), joined=(1,), last_joined=1)
    _ = response.cacheable  # fill in the cached property before pickling: it must not travel
    got = pickle.loads(pickle.dumps(response))
    assert got == response and got.signature is sig and "cacheable" not in vars(got)
    assert len(pickle.dumps(response)) < 400


def test_coordinator_fast_agreement_still_catches_every_mismatch_after_pickling():
    import pickle

    c = Coordinator([0, 1])
    same = pickle.loads(pickle.dumps(ar((2, 3))))
    c.submit(0, [("t", ar((2, 3)))])
    c.submit(1, [("t", same)])
    [ok] = c.ready()
    assert ok.error is None
    c.submit(0, [("u", ar((2, 3)))])
    c.submit(1, [("u", pickle.loads(pickle.dumps(ar((2, 4)))))])
    [bad] = c.ready()
    assert "shapes" in bad.error


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_coordinator_mismatch_names_ranks_and_values(what):
    first, second, values = MISMATCHES[what]
    c = Coordinator([5, 7])  # member index -> global rank: messages must use global ranks
    c.submit(0, [("t", first)])
    c.submit(1, [("t", second)])
    [response] = c.ready()
    assert response.error is not None
    assert what in response.error and "'t'" in response.error
    assert "rank 5" in response.error and "rank 7" in response.error
    for value in values:
        assert value in response.error
    assert not response.cacheable


def test_coordinator_allgather_first_dimension_may_differ_but_not_the_rest():
    c = Coordinator([0, 1, 2])
    for member, rows in enumerate((1, 3, 0)):
        c.submit(member, [("g", Signature(Kind.ALLGATHER, "float32", (rows, 2)))])
    [ok] = c.ready()
    assert ok.error is None and ok.rows == (1, 3, 0)

    c.submit(0, [("h", Signature(Kind.ALLGATHER, "float32", (2, 2)))])
    c.submit(1, [("h", Signature(Kind.ALLGATHER, "float32", (2, 3)))])
    c.submit(2, [("h", Signature(Kind.ALLGATHER, "float32", (2, 2)))])
    [bad] = c.ready()
    assert bad.error is not None and "first dimension" in bad.error and "[2, 3]" in bad.error


def test_coordinator_allreduce_shapes_must_match_exactly():
    c = Coordinator([0, 1])
    c.submit(0, [("t", ar((2, 3)))])
    c.submit(1, [("t", ar((3, 2)))])
    [response] = c.ready()
    assert "shapes" in response.error


def _alltoall(rows, splits):
    return Signature(Kind.ALLTOALL, "float32", (rows, 2), splits=tuple(splits))


def test_coordinator_alltoall_collects_every_members_splits():
    c = Coordinator([0, 1])
    c.submit(0, [("a", _alltoall(3, (1, 2)))])
    c.submit(1, [("a", _alltoall(4, (4, 0)))])
    [response] = c.ready()
    assert response.error is None and response.splits == ((1, 2), (4, 0))


@pytest.mark.parametrize("splits", [(1, 1, 1), (1, 1), (4, -1)], ids=["wrong-length", "wrong-sum", "negative"])
def test_coordinator_alltoall_rejects_bad_splits_naming_the_rank(splits):
    c = Coordinator([0, 1])
    c.submit(0, [("a", _alltoall(3, (1, 2)))])
    c.submit(1, [("a", _alltoall(3, splits))])
    [response] = c.ready()
    assert response.error is not None and "splits" in response.error and "rank 1" in response.error


def test_coordinator_broadcast_root_must_be_a_member():
    c = Coordinator([0, 1])
    sig = Signature(Kind.BROADCAST, "float32", (2,), root=4)
    c.submit(0, [("b", sig)])
    c.submit(1, [("b", sig)])
    [response] = c.ready()
    assert response.error is not None and "root rank 4" in response.error


# ---- Coordinator: stall report -----------------------------------------------------------------


def test_coordinator_stall_warns_with_missing_ranks_then_fails():
    c = Coordinator([0, 1, 2])
    c.submit(0, [("x", ar())], now=100.0)
    c.submit(1, [("x", ar())], now=100.0)
    c.submit(0, [("done", ar())], now=100.0)
    for member in (1, 2):
        c.submit(member, [("done", ar())], now=100.0)
    assert [r.name for r in c.ready()] == ["done"]

    early = c.stalls(100.5, warn_after=1.0, fail_after=3.0)
    assert early.warnings == [] and early.fatal is None

    first = c.stalls(101.5, warn_after=1.0, fail_after=3.0)
    assert first.fatal is None
    [warning] = first.warnings
    assert "'x'" in warning and "missing ranks [2]" in warning
    # Not repeated until another warning period has passed.
    assert c.stalls(102.0, warn_after=1.0, fail_after=3.0).warnings == []
    assert len(c.stalls(102.6, warn_after=1.0, fail_after=3.0).warnings) == 1

    late = c.stalls(103.1, warn_after=1.0, fail_after=3.0)
    assert late.fatal is not None
    assert "'x'" in late.fatal and "[0, 1]" in late.fatal and "[2]" in late.fatal


def test_coordinator_stall_limit_zero_never_fails_and_joined_ranks_are_not_missing():
    c = Coordinator([0, 1])
    c.submit(0, [("x", ar())], now=0.0)
    report = c.stalls(1000.0, warn_after=1.0, fail_after=0.0)
    assert report.fatal is None and len(report.warnings) == 1

    c = Coordinator([0, 1])
    c.submit(0, [("x", ar())], now=0.0)
    c.submit(1, [("j", JOIN)], now=0.0)
    assert c.stalls(1000.0, warn_after=1.0, fail_after=3.0) == type(report)([], None)


# ---- ResponseCache ----------------------------------------------------------------------------


def _response(name: str, sig: Signature | None = None, **fields) -> Response:
    return Response(name, sig or ar(), **fields)


def test_cache_hit_miss_invalid():
    cache = ResponseCache(4)
    sig = ar()
    assert cache.lookup("a", sig) == (Lookup.MISS, -1)
    assert cache.put(_response("a", sig), sig) is None
    status, bit = cache.lookup("a", sig)
    assert status is Lookup.HIT and 0 <= bit < 4
    assert cache.response(bit).name == "a" and cache.has_bit(bit, "a")
    assert cache.lookup("a", ar((5,))) == (Lookup.INVALID, bit)
    assert cache.lookup("a", ar(dtype="float64"))[0] is Lookup.INVALID
    cache.evict_bit(bit)
    assert cache.lookup("a", sig) == (Lookup.MISS, -1) and len(cache) == 0


def test_cache_lru_eviction_is_deterministic_and_put_returns_the_evicted_bit():
    def fill() -> tuple[ResponseCache, dict[str, int]]:
        cache = ResponseCache(3)
        bits = {}
        for name in "abc":
            assert cache.put(_response(name), ar()) is None
            bits[name] = cache.lookup(name, ar())[1]
        return cache, bits

    cache, bits = fill()
    assert sorted(bits.values()) == [0, 1, 2]
    cache.touch("a")  # b is now the least recently used
    evicted = cache.put(_response("d"), ar())
    assert evicted == bits["b"]
    assert cache.lookup("b", ar())[0] is Lookup.MISS
    assert cache.lookup("d", ar()) == (Lookup.HIT, bits["b"])  # the freed bit is reused
    assert len(cache) == 3
    # Re-putting an existing name refreshes it and evicts nothing.
    assert cache.put(_response("a"), ar()) is None
    assert cache.put(_response("e"), ar()) == bits["c"]

    # The same sequence on another member gives the same bits.
    other, other_bits = fill()
    other.touch("a")
    assert other.put(_response("d"), ar()) == evicted
    assert other_bits == bits


def test_cache_disabled_or_uncacheable_stores_nothing():
    off = ResponseCache(0)
    assert not off.enabled and off.put(_response("a"), ar()) is None and len(off) == 0
    cache = ResponseCache(2)
    assert cache.put(_response("err", error="boom"), ar()) is None
    assert cache.put(_response("joined", joined=(1,)), ar()) is None
    assert cache.put(_response("b", Signature(Kind.BARRIER, "uint8", ())), ar()) is None
    assert len(cache) == 0
    with pytest.raises(KeyError):
        cache.response(0)


# ---- plan_buckets -----------------------------------------------------------------------------


def _items(specs) -> list[Item]:
    return [Item(_response(name, sig), None) for name, sig in specs]


def _names(buckets) -> list[list[str]]:
    return [[i.response.name for i in b.items] for b in buckets]


def test_plan_buckets_respects_the_fusion_threshold():
    items = _items((f"t{i}", ar((100,))) for i in range(10))  # 400 bytes each
    buckets = plan_buckets(items, 1000)
    assert _names(buckets) == [[f"t{i}", f"t{i + 1}"] for i in range(0, 10, 2)]
    assert all(b.nbytes <= 1000 for b in buckets)
    assert _names(plan_buckets(items, 4000)) == [[f"t{i}" for i in range(10)]]


def test_plan_buckets_threshold_zero_disables_fusion():
    items = _items((f"t{i}", ar((1,))) for i in range(5))
    assert _names(plan_buckets(items, 0)) == [[f"t{i}"] for i in range(5)]


def test_plan_buckets_fuses_only_compatible_requests():
    items = _items([
        ("f32a", ar()), ("f64", ar(dtype="float64")), ("f32b", ar()), ("max", ar(op="max")),
        ("scaled", ar(prescale=2.0)), ("f32c", ar()),
        ("bc", Signature(Kind.BROADCAST, "float32", (4,), root=0)),
        ("rs", Signature(Kind.REDUCESCATTER, "float32", (4,))),
    ])
    assert _names(plan_buckets(items, 1 << 20)) == [
        ["f32a", "f32b", "f32c"], ["f64"], ["max"], ["scaled"], ["bc"], ["rs"],
    ]


def test_plan_buckets_never_splits_a_group():
    g = dict(group="g", group_size=3)
    items = _items([("a", ar((100,)))] + [(f"g.{i}", ar((100,), **g)) for i in range(3)] + [("b", ar((100,)))])
    buckets = plan_buckets(items, 500)  # the group alone (1200 bytes) is over the threshold
    assert ["g.0", "g.1", "g.2"] in _names(buckets)
    for bucket in buckets:
        names = [i.response.name for i in bucket.items]
        assert not any(n.startswith("g.") for n in names) or names == ["g.0", "g.1", "g.2"]
    assert sorted(sum(_names(buckets), [])) == sorted(["a", "b", "g.0", "g.1", "g.2"])
    assert _names(plan_buckets(items, 0)) == [["a"], ["g.0", "g.1", "g.2"], ["b"]]


def test_plan_buckets_keeps_a_mixed_dtype_group_together_per_dtype():
    g = dict(group="g", group_size=3)
    items = _items([("g.0", ar(**g)), ("g.1", ar(dtype="float64", **g)), ("g.2", ar(**g))])
    assert _names(plan_buckets(items, 1 << 20)) == [["g.0", "g.2"], ["g.1"]]
    assert [b.key[1] for b in plan_buckets(items, 0)] == ["float32", "float64"]


def test_plan_buckets_same_inputs_give_same_buckets():
    def build():
        specs = [(f"t{i}", ar((i * 7 % 50 + 1,), dtype=("float32", "float64")[i % 2])) for i in range(40)]
        return _items(specs)

    first = [(b.key, _names([b])[0], b.nbytes) for b in plan_buckets(build(), 600)]
    second = [(b.key, _names([b])[0], b.nbytes) for b in plan_buckets(build(), 600)]
    assert first == second and len(first) > 2


def test_reducescatter_rows_give_earlier_ranks_the_remainder():
    assert reducescatter_rows(7, 3) == [3, 2, 2]
    assert reducescatter_rows(2, 3) == [1, 1, 0]
    assert reducescatter_rows(6, 3) == [2, 2, 2]


# ---- Scaling ------------------------------------------------------------------------------------


def test_float16_scaling_rounds_the_factor_to_float32_not_to_float16():
    from hora.engine.executor import _scale

    factor = 0.1915194503788923  # its float16 rounding differs from its float32 rounding
    x = np.arange(-100, 100, dtype=np.float16)
    got = x.copy()
    _scale(got, factor)
    want = (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_integer_scaling_is_done_in_float64_and_truncates_toward_zero():
    from hora.engine.executor import _scale

    x = np.array([-7, -3, 3, 7], dtype=np.int32)
    _scale(x, 0.5)
    assert x.tolist() == [-3, -1, 1, 3]


def test_average_divides_the_postscale_factor_by_the_number_of_ranks():
    from hora.engine.executor import _postscale

    # 2.5 / 3 and 2.5 * (1 / 3) differ in the last bit; Horovod divides.
    sig = signature(Kind.ALLREDUCE, "float64", (2,), ReduceOp.AVERAGE, -1, 1.0, 2.5)
    assert _postscale(sig, 3) == 2.5 / 3 != 2.5 * (1.0 / 3)
    assert _postscale(signature(Kind.ALLREDUCE, "float64", (2,), ReduceOp.SUM, -1, 1.0, 2.5), 3) == 2.5


# ---- Timeline -----------------------------------------------------------------------------------


class _ObservedTimeline(Timeline):
    """Reports each batch the writer thread has appended, so a test can wait for it."""

    def __init__(self, path: str) -> None:
        self.batches: queue.Queue[int] = queue.Queue()
        super().__init__(path)

    def _append(self, records: list[dict]) -> None:
        super()._append(records)
        self.batches.put(len(records))


def _wait_written(tl: _ObservedTimeline, count: int) -> None:
    written = 0
    while written < count:
        written += tl.batches.get(timeout=10)


def test_timeline_file_is_valid_json_after_every_batch_and_before_close(tmp_path):
    path = tmp_path / "sub" / "timeline.json"
    tl = _ObservedTimeline(str(path))
    try:
        assert json.loads(path.read_text()) == []
        tl.negotiate_start("grad/a", "ALLREDUCE")  # + process_name and process_sort_index metadata
        tl.negotiate_rank_ready("grad/a", 0)
        _wait_written(tl, 4)
        events = json.loads(path.read_text())
        assert [e["ph"] for e in events] == ["M", "M", "B", "i"]
        assert events[0]["name"] == "process_name" and events[0]["args"] == {"name": "grad/a"}

        tl.negotiate_end("grad/a", "ALLREDUCE")
        tl.start("grad/a", "ALLREDUCE")
        tl.activity_start("grad/a", "QUEUE")
        tl.activity_end("grad/a", "QUEUE")
        tl.end("grad/a", "ALLREDUCE", "float32", (2, 3))
        tl.start("grad/b", "BROADCAST")
        _wait_written(tl, 8)
        events = json.loads(path.read_text())
        assert len(events) == 12
        end = [e for e in events if e["ph"] == "E" and e["name"] == "ALLREDUCE"]
        assert end[0]["args"] == {"dtype": "float32", "shape": [2, 3]}
        pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
        assert set(pids) == {"grad/a", "grad/b"} and pids["grad/a"] != pids["grad/b"]
        assert all(isinstance(e["ts"], int) for e in events if "ts" in e)
    finally:
        tl.close()
    assert len(json.loads(path.read_text())) == 12


def test_timeline_marks_cycles_only_when_asked(tmp_path):
    quiet = Timeline(str(tmp_path / "quiet.json"))
    quiet.cycle()
    quiet.close()
    assert json.loads((tmp_path / "quiet.json").read_text()) == []
    marked = Timeline(str(tmp_path / "marked.json"), mark_cycles=True)
    marked.cycle()
    marked.close()
    [event] = json.loads((tmp_path / "marked.json").read_text())
    assert event["name"] == "CYCLE_START" and event["ph"] == "i"


def test_timeline_drops_an_end_without_a_begin_so_spans_stay_balanced(tmp_path):
    path = tmp_path / "balanced.json"
    tl = Timeline(str(path))
    tl.negotiate_end("late", "ALLREDUCE")  # began before this timeline existed
    tl.end("late", "ALLREDUCE", "float32", (1,))
    assert not tl.is_open("a", "NEGOTIATE_ALLREDUCE")
    tl.negotiate_start("a", "ALLREDUCE")
    assert tl.is_open("a", "NEGOTIATE_ALLREDUCE")
    tl.negotiate_end("a", "ALLREDUCE")
    assert not tl.is_open("a", "NEGOTIATE_ALLREDUCE")
    tl.activity_start("a", "QUEUE")
    tl.activity_start("a", "QUEUE")
    tl.activity_end("a", "QUEUE")
    assert tl.is_open("a", "QUEUE")
    tl.activity_end("a", "QUEUE")
    tl.close()
    events = json.loads(path.read_text())
    assert [(e["ph"], e["name"]) for e in events if e["ph"] in "BE"] == [
        ("B", "NEGOTIATE_ALLREDUCE"), ("E", "NEGOTIATE_ALLREDUCE"),
        ("B", "QUEUE"), ("B", "QUEUE"), ("E", "QUEUE"), ("E", "QUEUE"),
    ]
    assert "late" not in {e["args"]["name"] for e in events if e["name"] == "process_name"}


def test_cache_reuses_the_lowest_freed_bit_and_sizes_the_control_vector_by_bits_handed_out():
    cache = ResponseCache(200)
    assert cache.words == 0
    for i in range(70):
        cache.put(_response(f"t{i}"), ar())
    assert cache.high_water == 70 and cache.words == 2
    for name in ("t5", "t66", "t3"):
        cache.evict_bit(cache.lookup(name, ar())[1])
    cache.put(_response("new.a"), ar())
    cache.put(_response("new.b"), ar())
    assert cache.lookup("new.a", ar())[1] == 3 and cache.lookup("new.b", ar())[1] == 5
    assert cache.high_water == 70  # freed bits are reused before new ones are handed out
    cache.clear()
    assert cache.high_water == 0 and cache.words == 0


def test_signatures_are_shared_objects_that_still_compare_by_value():
    a = signature(Kind.ALLREDUCE, "float32", (3, 4), "average")
    assert signature(Kind.ALLREDUCE, "float32", (3, 4), "average") is a
    assert Signature(Kind.ALLREDUCE, "float32", (3, 4), "average") == a  # built directly: equal, not same
    assert hash(Signature(Kind.ALLREDUCE, "float32", (3, 4), "average")) == hash(a)
    assert signature(Kind.ALLREDUCE, "float32", (3, 4), "sum") != a
    assert a != ("ALLREDUCE", "float32")


# ---- the control vector -------------------------------------------------------------------------


class _AndWithPeers:
    """A fake communicator: the BAND allreduce with fixed peer vectors."""

    def __init__(self, peers: list[list[int]]) -> None:
        self.size = 1 + len(peers)
        self.peers = peers

    def allreduce(self, buf, op) -> None:
        assert op is ReduceOp.BAND and buf.dtype == np.int64
        for peer in self.peers:
            buf &= np.asarray(peer, dtype=np.uint64).view(np.int64)


def _encode(words: int, flags: int, invalid: int, ready: int) -> list[int]:
    full = (1 << (64 * words)) - 1
    raw = ((~flags) & (2**64 - 1)).to_bytes(8, "little") + ((~invalid) & full).to_bytes(8 * words, "little") \
        + ready.to_bytes(8 * words, "little")
    return [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]


def test_control_exchange_ors_flags_and_invalid_bits_and_ands_ready_bits_across_words():
    from hora.engine.engine import _exchange_control

    bits = lambda *b: sum(1 << x for x in b)  # noqa: E731
    words = 3  # bits up to 191
    peer = _encode(words, flags=2, invalid=bits(70), ready=bits(0, 64, 130, 191))
    comm = _AndWithPeers([peer])
    flags, invalid, ready = _exchange_control(
        comm, words, 1, bits(5, 190), bits(0, 64, 65, 191), np.zeros(3, np.uint64))
    assert flags == 3
    assert invalid == bits(5, 70, 190)
    assert ready == bits(0, 64, 191)


def test_control_exchange_in_one_word_reuses_the_sets_vector_cycle_after_cycle():
    from hora.engine.engine import _exchange_control

    control = np.zeros(3, np.uint64)
    comm = _AndWithPeers([_encode(1, flags=2, invalid=1 << 63, ready=0b1011 | 1 << 63)])
    assert _exchange_control(comm, 1, 1, 0b100, 0b0110 | 1 << 63, control) == (3, 0b100 | 1 << 63, 0b0010 | 1 << 63)
    comm = _AndWithPeers([_encode(1, flags=0, invalid=0, ready=0b1)])
    assert _exchange_control(comm, 1, 0, 0, 0b11, control) == (0, 0, 0b1)  # nothing left from the last cycle


def test_control_exchange_of_a_one_member_set_is_its_own_vector():
    from hora.engine.engine import _exchange_control

    comm = _AndWithPeers([])
    assert _exchange_control(comm, 1, 1, 4, 9, np.zeros(3, np.uint64)) == (1, 4, 9)


def test_fine_timer_slack_lowers_the_calling_threads_slack_once():
    import ctypes
    import sys
    import threading

    from hora.transport.timer_slack import fine_timer_slack

    if not sys.platform.startswith("linux"):
        pytest.skip("timer slack is a Linux setting")
    prctl = ctypes.CDLL(None).prctl
    seen = {}

    def probe() -> None:
        seen["before"] = prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
        fine_timer_slack()
        fine_timer_slack()
        seen["after"] = prctl(30, 0, 0, 0, 0)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    assert seen["after"] == 1000 and seen["after"] <= seen["before"]
