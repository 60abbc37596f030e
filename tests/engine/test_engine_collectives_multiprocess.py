"""hora's NumPy collectives across 2 and 3 real worker processes, checked against NumPy.

One ``hora.run`` per world size runs every sub-check and returns the outputs; the tests below
recompute what each rank must have received from the (deterministic) inputs of every rank.
The fixture's ids put the world size in every test's name (``[world_size_2]``, ``[world_size_3]``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from engine_helpers import job_env

import hora

pytestmark = pytest.mark.timeout(120)

DTYPES = ("float32", "float64", "int32", "int64", "float16", "bfloat16")
OPS = {"Average": hora.Average, "Sum": hora.Sum, "Min": hora.Min, "Max": hora.Max, "Product": hora.Product}
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}
RS_ROWS = 7  # reducescatter first dimension: divisible by neither 2 nor 3


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def data(rank: int, shape: tuple[int, ...], dtype: str, salt: int = 0, span: int = 9) -> np.ndarray:
    """Small integers (exact in every dtype) that differ by rank, position and ``salt``."""
    flat = (np.arange(math.prod(shape)) * 7 + rank * 5 + salt * 3) % span - span // 2
    return flat.reshape(shape).astype(np_dtype(dtype))


def static_ranks(size: int) -> list[int]:
    return [0, size - 1] if size > 2 else [size - 1]


def dynamic_ranks(size: int) -> list[int]:
    return [1, size - 1] if size > 2 else [0]


def a2a_splits(rank: int, size: int) -> list[int]:
    return [(rank + j) % 3 for j in range(size)]


# ---- the job -------------------------------------------------------------------------------------


def _collectives_job(tmpdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    # Lifecycle: init, shutdown, init again (with a static process set) in a multi-process job.
    hora.init()
    r, n = hora.rank(), hora.size()
    out["topology"] = (r, n, hora.local_rank(), hora.local_size(), hora.cross_rank(), hora.cross_size(),
                       hora.is_homogeneous())
    out["before_reinit"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum, name="reinit")
    hora.shutdown()
    static = hora.ProcessSet(static_ranks(n))
    hora.init(process_sets=[static])
    out["after_reinit"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum, name="reinit")

    # Allreduce: every dtype x op, submitted together (negotiated and fused as a burst).
    handles = {}
    for dtype in DTYPES:
        for op_name, op in OPS.items():
            span = 5 if op_name == "Product" else 9
            handles[f"{dtype}/{op_name}"] = hora.allreduce_async(
                data(r, (3, 5), dtype, salt=len(handles), span=span), op=op, name=f"ar.{dtype}.{op_name}")
    out["allreduce"] = {key: hora.synchronize(h) for key, h in handles.items()}
    out["allreduce_default_op"] = hora.allreduce(data(r, (4,), "float64"), name="ar.default")
    out["allreduce_average_false"] = hora.allreduce(data(r, (4,), "float64"), average=False, name="ar.avgfalse")
    out["allreduce_big"] = hora.allreduce(data(r, (300_000,), "float32"), op=hora.Sum, name="ar.big")
    out["allreduce_3d"] = hora.allreduce(data(r, (2, 3, 4), "float32"), op=hora.Sum, name="ar.3d")

    # Edge cases: empty tensors, bool (logical or/and), narrow integer types.
    edge: dict[str, Any] = {}
    edge["empty_allreduce"] = hora.allreduce(np.zeros((0, 3), np.float32), op=hora.Sum, name="edge.empty")
    edge["empty_allgather"] = hora.allgather(np.zeros((0, 2), np.int32), name="edge.empty_gather")
    edge["tiny_reducescatter"] = hora.reducescatter(np.full((1, 3), r + 1.0), op=hora.Sum, name="edge.tiny_rs")
    flags = np.array([r == 0, True, False])
    edge["bool_max"] = hora.allreduce(flags, op=hora.Max, name="edge.bool_max")
    edge["bool_min"] = hora.allreduce(flags, op=hora.Min, name="edge.bool_min")
    edge["uint8_sum"] = hora.allreduce(np.array([r, 7, 100], np.uint8), op=hora.Sum, name="edge.u8")
    edge["int8_min"] = hora.allreduce(np.array([-r, 3], np.int8), op=hora.Min, name="edge.i8")
    edge["int16_product"] = hora.allreduce(np.array([r + 2, -1], np.int16), op=hora.Product, name="edge.i16")
    edge["scalar"] = hora.allreduce(np.float64(r + 1), op=hora.Sum, name="edge.scalar")
    out["edge"] = edge

    # Scale factors.
    out["scaled_sum"] = hora.allreduce(data(r, (6,), "float32"), op=hora.Sum, prescale_factor=0.5,
                                       postscale_factor=3.0, name="sc.sum")
    out["scaled_average"] = hora.allreduce(data(r, (6,), "float64"), op=hora.Average, prescale_factor=2.0,
                                           postscale_factor=0.5, name="sc.avg")
    out["scaled_int"] = hora.allreduce(data(r, (6,), "int32"), op=hora.Sum, postscale_factor=0.5, name="sc.int")

    # In place.
    buf = data(r, (5,), "float32")
    result = hora.allreduce_(buf, op=hora.Sum, name="inplace")
    out["inplace_same_object"] = result is buf
    out["inplace"] = buf.copy()
    buf2 = data(r, (5,), "int64")
    result2 = hora.synchronize(hora.allreduce_async_(buf2, op=hora.Max, name="inplace.async"))
    out["inplace_async_same_object"] = result2 is buf2
    out["inplace_async"] = buf2.copy()

    # Grouped allreduce.
    group = [data(r, (2, 3), "float32", 1), data(r, (4,), "float64", 2), data(r, (5,), "int32", 3)]
    out["grouped_sum"] = hora.grouped_allreduce(group, op=hora.Sum, name="grp.sum")
    out["grouped_average"] = [hora.synchronize(h) for h in
                              hora.grouped_allreduce_async(group, name="grp.avg")]
    # Mixed dtypes in one group: each member must be reduced in its own dtype (no float32 rounding).
    out["grouped_precise"] = hora.grouped_allreduce(
        [np.ones(2, np.float32), np.full(2, 1.0 + (r + 1) * 1e-12), np.full(2, 2**40 + r, np.int64)],
        op=hora.Sum, name="grp.precise")
    inplace_group = [data(r, (3,), "float32", 6), data(r, (2,), "float32", 7)]
    results_ = hora.grouped_allreduce_(inplace_group, op=hora.Sum, name="grp.inplace")
    out["grouped_inplace"] = ([a is b for a, b in zip(results_, inplace_group)], [a.copy() for a in inplace_group])

    # Allgather: first dimensions differ by rank (one rank has none); several fused at once.
    rows = [2, 0, 3][r]
    gathers = [hora.allgather_async(data(r, (rows, 3), "float32", 1), name="ag.f32"),
               hora.allgather_async(data(r, (rows,), "int64", 2), name="ag.i64"),
               hora.allgather_async(data(r, (rows + 1, 2, 2), "float16", 3), name="ag.f16")]
    out["allgather"] = [hora.synchronize(h) for h in gathers]
    out["grouped_allgather"] = hora.grouped_allgather(
        [data(r, (r + 1, 2), "float32", 4), data(r, (1 + 2 * r,), "bfloat16", 5)], name="gag")

    # Broadcast from every root, plain and in place.
    out["broadcast"], out["broadcast_input_kept"], out["broadcast_"] = [], [], []
    for root in range(n):
        x = data(r, (3, 2), "float32", salt=root)
        out["broadcast"].append(hora.broadcast(x, root_rank=root, name=f"bc.{root}"))
        out["broadcast_input_kept"].append(bool(np.array_equal(x, data(r, (3, 2), "float32", salt=root))))
        y = data(r, (4,), "int32", salt=root)
        same = hora.broadcast_(y, root, name=f"bc_.{root}") is y
        out["broadcast_"].append((same, y.copy()))

    # Alltoall, with and without splits.
    even = np.array([[100 * r + i, i] for i in range(2 * n)], dtype=np.float32)
    out["alltoall_plain"] = hora.alltoall(even, name="a2a.plain")
    splits = a2a_splits(r, n)
    rows_sent = np.array([100 * r + i for i in range(sum(splits))], dtype=np.int32)
    got, received = hora.alltoall(rows_sent, splits=splits, name="a2a.splits")
    out["alltoall_splits"] = (got, np.asarray(received).tolist())

    # Reducescatter with a first dimension not divisible by the size.
    out["reducescatter_sum"] = hora.reducescatter(data(r, (RS_ROWS, 2), "float32"), op=hora.Sum, name="rs.sum")
    out["reducescatter_average"] = hora.reducescatter(data(r, (RS_ROWS, 2), "float64"), name="rs.avg")
    out["reducescatter_int_average"] = hora.reducescatter(data(r, (RS_ROWS,), "int32"), op=hora.Average,
                                                          name="rs.intavg")
    out["reducescatter_scaled"] = hora.reducescatter(data(r, (RS_ROWS,), "float32"), op=hora.Sum,
                                                     prescale_factor=2.0, postscale_factor=0.25, name="rs.scaled")
    # Blocks named by the caller (hora's addition): one member receives nothing, the rest differ.
    out["reducescatter_blocks"] = hora.reducescatter(data(r, (RS_ROWS, 2), "float32"), op=hora.Sum,
                                                     name="rs.blocks", blocks=rs_blocks(n))
    try:  # each rank names other blocks: every rank fails, naming what each named
        hora.reducescatter(data(r, (RS_ROWS,), "float32"), name="rs.blocks.mismatch",
                           blocks=[RS_ROWS if m == r else 0 for m in range(n)])
    except RuntimeError as exc:
        out["reducescatter_blocks_mismatch"] = (type(exc).__name__, str(exc))
    kept = data(r, (RS_ROWS,), "float32")
    out["reducescatter_kept_input"] = (hora.reducescatter(kept, op=hora.Sum, prescale_factor=2.0, name="rs.kept"),
                                       kept.copy())
    given = data(r, (RS_ROWS,), "float32")
    out["reducescatter_donated"] = hora.reducescatter(given, op=hora.Sum, prescale_factor=2.0, name="rs.donated",
                                                      blocks=rs_blocks(n), donate=True)
    try:
        hora.reducescatter(np.ones(RS_ROWS, np.float32), name="rs.blocks.wrong_sum", blocks=[1] * n)
    except ValueError as exc:
        out["reducescatter_blocks_wrong_sum"] = str(exc)
    out["grouped_reducescatter"] = hora.grouped_reducescatter(
        [data(r, (5, 2), "float32", 1), data(r, (4,), "float64", 2)], op=hora.Sum, name="grs")

    # Barrier, objects.
    out["barrier"] = hora.barrier()
    out["broadcast_object"] = hora.broadcast_object({"from": r, "payload": list(range(r + 3))}, root_rank=n - 1)
    out["allgather_object"] = hora.allgather_object(("rank", r, "x" * r))

    # poll before every rank submitted (rank 0 polls before the others pass the barrier), then after.
    if r == 0:
        h = hora.allreduce_async(np.ones(3, np.float32), op=hora.Sum, name="polled")
        before = hora.poll(h)
        hora.barrier()
        value = hora.synchronize(h)
        out["poll"] = (before, hora.poll(h), value)
    else:
        hora.barrier()
        h = hora.allreduce_async(np.ones(3, np.float32), op=hora.Sum, name="polled")
        value = hora.synchronize(h)
        out["poll"] = (None, hora.poll(h), value)

    # Process sets: a static one (from init) and a dynamic one; root_rank is global.
    ps_info: dict[str, Any] = {"static_id": static.process_set_id, "static_included": static.included(),
                               "static_size": static.size()}
    if static.included():
        ps_info["static_rank"] = static.rank()
        ps_info["static_sum"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum, name="ps.static.sum",
                                               process_set=static)
        ps_info["static_bcast"] = hora.broadcast(np.full(2, r + 1.0), root_rank=static.ranks[-1],
                                                 name="ps.static.bc", process_set=static)
    else:
        try:
            static.rank()
        except ValueError as exc:
            ps_info["static_rank_error"] = str(exc)
        try:
            hora.allreduce(np.ones(1), name="ps.static.outsider", process_set=static)
        except ValueError as exc:
            ps_info["outsider_error"] = str(exc)
    dynamic = hora.add_process_set(dynamic_ranks(n))
    ps_info["dynamic_id"] = dynamic.process_set_id
    ps_info["dynamic_included"] = dynamic.included()
    if dynamic.included():
        ps_info["dynamic_rank"] = dynamic.rank()
        ps_info["dynamic_sum"] = hora.allreduce(np.full(3, r + 1, np.int32), op=hora.Sum, name="ps.dyn.sum",
                                                process_set=dynamic)
        ps_info["dynamic_gather"] = hora.allgather(np.full(1, r), name="ps.dyn.gather", process_set=dynamic)
        ps_info["dynamic_bcast"] = hora.broadcast(np.full(2, r + 1.0), root_rank=dynamic.ranks[-1],
                                                  name="ps.dyn.bc", process_set=dynamic)
    try:
        hora.add_process_set(list(range(n)))
    except ValueError as exc:
        ps_info["duplicate_error"] = str(exc)
    ps_info["removed"] = hora.remove_process_set(dynamic)
    ps_info["removed_again"] = hora.remove_process_set(dynamic)
    try:
        hora.allreduce(np.ones(1), name="ps.removed", process_set=dynamic)
    except ValueError as exc:
        ps_info["after_remove_error"] = str(exc)
    ps_info["world_after"] = hora.allreduce(np.ones(1), op=hora.Sum, name="ps.world_after")
    out["process_sets"] = ps_info

    # Timeline started and stopped from the API (the 2-rank job also has HORA_TIMELINE set).
    api_path = f"{tmpdir}/api_timeline.json"
    hora.start_timeline(api_path)
    hora.allreduce(np.ones(4, np.float32), name="tl.api.allreduce")
    hora.allgather(np.ones((r + 1, 2), np.float32), name="tl.api.allgather")
    hora.stop_timeline()
    out["api_timeline"] = api_path

    # Join, last (auto-named joins keep every rank's name counter in step).
    # Round 1: the last rank joins at once; the others reduce, then join one by one, rank 0 last.
    steady = np.full(2, r + 1.0)
    hora.allreduce(steady, op=hora.Sum, name="join.steady")
    hora.allreduce(steady, op=hora.Sum, name="join.steady")  # now served from the response cache
    joins: dict[str, Any] = {}
    if r == n - 1:
        joins["last"] = hora.join()
    else:
        joins["sum"] = hora.allreduce(np.full(3, r + 1.0), op=hora.Sum, name="join.sum")
        joins["avg"] = hora.allreduce(np.full(3, r + 1.0), op=hora.Average, name="join.avg")
        joins["int_avg"] = hora.allreduce(np.full(3, r + 1, np.int32), op=hora.Average, name="join.intavg")
        joins["cached"] = hora.allreduce(steady, op=hora.Sum, name="join.steady")
        joins["grouped"] = hora.grouped_allreduce([np.full(2, r + 1.0), np.full(1, r + 1.0)], op=hora.Sum,
                                                  name="join.grouped")
        if r != 0:
            joins["last"] = hora.join()
        else:
            joins["solo"] = hora.allreduce(np.full(3, 10.0), op=hora.Sum, name="join.solo")
            joins["last"] = hora.join()
    # Round 2: rank 0 joins at once; the last rank joins last.
    if r == 0:
        joins["last2"] = hora.join()
    else:
        joins["sum2"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum, name="join2.sum")
        if r == n - 1 and n > 2:  # runs only once rank 1 has joined: the last rank joins last
            joins["solo2"] = hora.allreduce(np.full(2, 1.0), op=hora.Sum, name="join2.solo")
        joins["last2"] = hora.join()
    joins["after"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum, name="join.after")
    out["join"] = joins

    hora.shutdown()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world_size_2", "world_size_3"])
def job(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]], str]:
    size = request.param
    tmp = tmp_path_factory.mktemp(f"collectives{size}")
    env = job_env(stall_check_time_seconds=5, stall_shutdown_time_seconds=20)
    if size == 2:
        env.update(job_env(timeline=f"{tmp}/env_timeline.json"))
    results = hora.run(_collectives_job, args=(str(tmp),), np=size, env=env)
    return size, results, str(tmp)


def _expected_reduce(inputs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    stack = np.stack([x.astype(np.float64) for x in inputs])
    size = len(inputs)
    if op in ("Sum", "Average"):
        value = stack.sum(axis=0)
        if op == "Average":
            value = np.trunc(value / size) if np_dtype(dtype).kind in "iu" else value / size
        return value
    return {"Min": stack.min(axis=0), "Max": stack.max(axis=0), "Product": stack.prod(axis=0)}[op]


def _assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    assert actual.dtype == np_dtype(dtype), (actual.dtype, dtype)
    rtol = TOLERANCE.get(dtype, 0.0)
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=rtol, atol=rtol)


def rs_blocks(size: int) -> list[int]:
    """Rows each member receives in the ``blocks`` check: none for the first, the rest to the last."""
    middle = list(range(1, size - 1))
    return [0, *middle, RS_ROWS - sum(middle)]


def _rs_slices(rows: int, size: int) -> list[slice]:
    base, extra = divmod(rows, size)
    counts = [base + (1 if m < extra else 0) for m in range(size)]
    starts = np.cumsum([0] + counts)
    return [slice(int(starts[m]), int(starts[m + 1])) for m in range(size)]


# ---- tests ---------------------------------------------------------------------------------------


def test_topology_and_reinit(job):
    size, results, _ = job
    for r, res in enumerate(results):
        assert res["topology"] == (r, size, r, size, 0, 1, True)
        expected = sum(range(1, size + 1))
        np.testing.assert_array_equal(res["before_reinit"], [expected] * 2)
        np.testing.assert_array_equal(res["after_reinit"], [expected] * 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_op_matches_numpy(job, dtype):
    size, results, _ = job
    keys = [f"{d}/{o}" for d in DTYPES for o in OPS]
    for op_name in OPS:
        salt = keys.index(f"{dtype}/{op_name}")
        span = 5 if op_name == "Product" else 9
        inputs = [data(r, (3, 5), dtype, salt=salt, span=span) for r in range(size)]
        expected = _expected_reduce(inputs, op_name, dtype)
        for res in results:
            _assert_close(res["allreduce"][f"{dtype}/{op_name}"], expected, dtype)


def test_allreduce_defaults_big_and_multidimensional(job):
    size, results, _ = job
    inputs = [data(r, (4,), "float64") for r in range(size)]
    for res in results:
        _assert_close(res["allreduce_default_op"], _expected_reduce(inputs, "Average", "float64"), "float64")
        _assert_close(res["allreduce_average_false"], _expected_reduce(inputs, "Sum", "float64"), "float64")
        big = _expected_reduce([data(r, (300_000,), "float32") for r in range(size)], "Sum", "float32")
        _assert_close(res["allreduce_big"], big, "float32")
        cube = _expected_reduce([data(r, (2, 3, 4), "float32") for r in range(size)], "Sum", "float32")
        assert res["allreduce_3d"].shape == (2, 3, 4)
        _assert_close(res["allreduce_3d"], cube, "float32")


def test_edge_cases_empty_bool_and_narrow_integers(job):
    size, results, _ = job
    for r, res in enumerate(results):
        edge = res["edge"]
        assert edge["empty_allreduce"].shape == (0, 3) and edge["empty_allreduce"].dtype == np.float32
        assert edge["empty_allgather"].shape == (0, 2)
        want_rows = 1 if r == 0 else 0  # one row for the first rank, none for the others
        np.testing.assert_array_equal(edge["tiny_reducescatter"],
                                      np.full((want_rows, 3), float(sum(range(1, size + 1)))))
        np.testing.assert_array_equal(edge["bool_max"], [True, True, False])
        np.testing.assert_array_equal(edge["bool_min"], [False, True, False])
        assert edge["bool_max"].dtype == np.bool_
        np.testing.assert_array_equal(edge["uint8_sum"], [sum(range(size)), 7 * size, (100 * size) % 256])
        np.testing.assert_array_equal(edge["int8_min"], [-(size - 1), 3])
        np.testing.assert_array_equal(edge["int16_product"], [math.prod(range(2, size + 2)), (-1) ** size])
        assert edge["scalar"].shape == () and float(edge["scalar"]) == sum(range(1, size + 1))


def test_allreduce_prescale_and_postscale(job):
    size, results, _ = job
    f32 = _expected_reduce([data(r, (6,), "float32") * 0.5 for r in range(size)], "Sum", "float32") * 3.0
    f64 = _expected_reduce([data(r, (6,), "float64") * 2.0 for r in range(size)], "Average", "float64") * 0.5
    ints = np.trunc(_expected_reduce([data(r, (6,), "int32") for r in range(size)], "Sum", "int32") * 0.5)
    for res in results:
        _assert_close(res["scaled_sum"], f32, "float32")
        _assert_close(res["scaled_average"], f64, "float64")
        _assert_close(res["scaled_int"], ints, "int32")


def test_allreduce_in_place(job):
    size, results, _ = job
    for res in results:
        assert res["inplace_same_object"] and res["inplace_async_same_object"]
        _assert_close(res["inplace"], _expected_reduce([data(r, (5,), "float32") for r in range(size)], "Sum",
                                                       "float32"), "float32")
        _assert_close(res["inplace_async"], _expected_reduce([data(r, (5,), "int64") for r in range(size)], "Max",
                                                             "int64"), "int64")


def test_grouped_allreduce(job):
    size, results, _ = job
    specs = [((2, 3), "float32", 1), ((4,), "float64", 2), ((5,), "int32", 3)]
    for res in results:
        for out_sum, out_avg, (shape, dtype, salt) in zip(res["grouped_sum"], res["grouped_average"], specs):
            inputs = [data(r, shape, dtype, salt) for r in range(size)]
            _assert_close(out_sum, _expected_reduce(inputs, "Sum", dtype), dtype)
            _assert_close(out_avg, _expected_reduce(inputs, "Average", dtype), dtype)


def test_grouped_allreduce_keeps_each_members_dtype_and_precision(job):
    size, results, _ = job
    for res in results:
        f32, f64, i64 = res["grouped_precise"]
        assert (f32.dtype, f64.dtype, i64.dtype) == (np.float32, np.float64, np.int64)
        np.testing.assert_array_equal(f32, [size] * 2)
        np.testing.assert_allclose(f64, [size + sum(range(1, size + 1)) * 1e-12] * 2, rtol=1e-15)
        np.testing.assert_array_equal(i64, [size * 2**40 + sum(range(size))] * 2)
        same, values = res["grouped_inplace"]
        assert same == [True, True]
        for value, (shape, salt) in zip(values, (((3,), 6), ((2,), 7))):
            want = _expected_reduce([data(q, shape, "float32", salt) for q in range(size)], "Sum", "float32")
            _assert_close(value, want, "float32")


def test_allgather_with_different_first_dimensions(job):
    size, results, _ = job
    rows = [2, 0, 3][:size]
    expected = [
        np.concatenate([data(r, (rows[r], 3), "float32", 1) for r in range(size)]),
        np.concatenate([data(r, (rows[r],), "int64", 2) for r in range(size)]),
        np.concatenate([data(r, (rows[r] + 1, 2, 2), "float16", 3) for r in range(size)]),
    ]
    grouped = [
        np.concatenate([data(r, (r + 1, 2), "float32", 4) for r in range(size)]),
        np.concatenate([data(r, (1 + 2 * r,), "bfloat16", 5) for r in range(size)]),
    ]
    for res in results:
        for actual, want in zip(res["allgather"] + res["grouped_allgather"], expected + grouped):
            assert actual.dtype == want.dtype and actual.shape == want.shape
            np.testing.assert_array_equal(actual, want)


def test_broadcast_from_every_root(job):
    size, results, _ = job
    for res in results:
        for root in range(size):
            np.testing.assert_array_equal(res["broadcast"][root], data(root, (3, 2), "float32", salt=root))
            assert res["broadcast_input_kept"][root]
            same, value = res["broadcast_"][root]
            assert same
            np.testing.assert_array_equal(value, data(root, (4,), "int32", salt=root))


def test_alltoall_with_and_without_splits(job):
    size, results, _ = job
    for r, res in enumerate(results):
        plain = res["alltoall_plain"]
        want = np.array([[100 * j + 2 * r + k, 2 * r + k] for j in range(size) for k in range(2)], np.float32)
        np.testing.assert_array_equal(plain, want)

        got, received = res["alltoall_splits"]
        expected_rows = []
        for j in range(size):
            s = a2a_splits(j, size)
            start = sum(s[:r])
            expected_rows += [100 * j + i for i in range(start, start + s[r])]
        assert received == [a2a_splits(j, size)[r] for j in range(size)]
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, expected_rows)


def test_reducescatter_gives_earlier_ranks_the_extra_rows(job):
    size, results, _ = job
    slices = _rs_slices(RS_ROWS, size)
    total = _expected_reduce([data(r, (RS_ROWS, 2), "float32") for r in range(size)], "Sum", "float32")
    avg = _expected_reduce([data(r, (RS_ROWS, 2), "float64") for r in range(size)], "Average", "float64")
    int_avg = _expected_reduce([data(r, (RS_ROWS,), "int32") for r in range(size)], "Average", "int32")
    scaled = _expected_reduce([data(r, (RS_ROWS,), "float32") * 2.0 for r in range(size)], "Sum", "float32") * 0.25
    for r, res in enumerate(results):
        assert res["reducescatter_sum"].shape == (slices[r].stop - slices[r].start, 2)
        _assert_close(res["reducescatter_sum"], total[slices[r]], "float32")
        _assert_close(res["reducescatter_average"], avg[slices[r]], "float64")
        _assert_close(res["reducescatter_int_average"], int_avg[slices[r]], "int32")
        _assert_close(res["reducescatter_scaled"], scaled[slices[r]], "float32")


def test_reducescatter_gives_each_member_the_blocks_the_caller_named(job):
    size, results, _ = job
    starts = np.cumsum([0] + rs_blocks(size))
    total = _expected_reduce([data(r, (RS_ROWS, 2), "float32") for r in range(size)], "Sum", "float32")
    for r, res in enumerate(results):
        assert res["reducescatter_blocks"].shape == (rs_blocks(size)[r], 2)
        _assert_close(res["reducescatter_blocks"], total[starts[r]:starts[r + 1]], "float32")


def test_a_donated_buffer_gives_the_same_result_and_an_undonated_one_is_left_as_it_was(job):
    size, results, _ = job
    doubled = _expected_reduce([data(r, (RS_ROWS,), "float32") * 2.0 for r in range(size)], "Sum", "float32")
    starts = np.cumsum([0] + rs_blocks(size))
    for r, res in enumerate(results):
        result, after = res["reducescatter_kept_input"]
        np.testing.assert_array_equal(after, data(r, (RS_ROWS,), "float32"))  # the prescale went into a copy
        _assert_close(result, doubled[_rs_slices(RS_ROWS, size)[r]], "float32")
        _assert_close(res["reducescatter_donated"], doubled[starts[r]:starts[r + 1]], "float32")


def test_reducescatter_blocks_that_ranks_disagree_on_fail_on_every_rank_naming_them(job):
    size, results, _ = job
    for res in results:
        kind, message = res["reducescatter_blocks_mismatch"]
        assert kind == "CollectivePreconditionError", message
        assert "Mismatched REDUCESCATTER blocks" in message, message
        for r in range(size):
            assert f"rank {r} has {[RS_ROWS if m == r else 0 for m in range(size)]}" in message, message
        assert "adding up to the first dimension 7" in res["reducescatter_blocks_wrong_sum"]


def test_grouped_reducescatter(job):
    size, results, _ = job
    specs = [((5, 2), "float32", 1), ((4,), "float64", 2)]
    for r, res in enumerate(results):
        assert len(res["grouped_reducescatter"]) == 2
        for actual, (shape, dtype, salt) in zip(res["grouped_reducescatter"], specs):
            total = _expected_reduce([data(q, shape, dtype, salt) for q in range(size)], "Sum", dtype)
            _assert_close(actual, total[_rs_slices(shape[0], size)[r]], dtype)


def test_barrier_and_objects(job):
    size, results, _ = job
    for res in results:
        assert res["barrier"] is None
        assert res["broadcast_object"] == {"from": size - 1, "payload": list(range(size + 2))}
        assert res["allgather_object"] == [("rank", q, "x" * q) for q in range(size)]


def test_poll_and_synchronize(job):
    size, results, _ = job
    assert results[0]["poll"][0] is False  # not every rank had submitted it yet
    for res in results:
        assert res["poll"][1] is True
        np.testing.assert_array_equal(res["poll"][2], [size] * 3)


def test_process_sets_static_and_dynamic(job):
    size, results, _ = job
    static, dynamic = static_ranks(size), dynamic_ranks(size)
    ids = {res["process_sets"]["static_id"] for res in results} | {res["process_sets"]["dynamic_id"] for res in results}
    assert len(ids) == 2 and 0 not in ids  # the same two ids on every rank
    for r, res in enumerate(results):
        ps = res["process_sets"]
        assert ps["static_included"] == (r in static) and ps["static_size"] == len(static)
        if r in static:
            assert ps["static_rank"] == static.index(r)
            np.testing.assert_array_equal(ps["static_sum"], [sum(q + 1.0 for q in static)] * 2)
            np.testing.assert_array_equal(ps["static_bcast"], [static[-1] + 1.0] * 2)
        else:
            assert "not in process set" in ps["static_rank_error"]
            assert "not in process set" in ps["outsider_error"]
        assert ps["dynamic_included"] == (r in dynamic)
        if r in dynamic:
            assert ps["dynamic_rank"] == dynamic.index(r)
            np.testing.assert_array_equal(ps["dynamic_sum"], [sum(q + 1 for q in dynamic)] * 3)
            np.testing.assert_array_equal(ps["dynamic_gather"], dynamic)
            np.testing.assert_array_equal(ps["dynamic_bcast"], [dynamic[-1] + 1.0] * 2)
        assert "already exists" in ps["duplicate_error"]
        assert ps["removed"] is True and ps["removed_again"] is False
        assert "not registered" in ps["after_remove_error"]
        np.testing.assert_array_equal(ps["world_after"], [size])


def test_join_counts_joined_ranks_as_zeros_and_returns_the_last_to_join(job):
    size, results, _ = job
    active = range(size - 1)  # round 1: the last rank joined first
    for r, res in enumerate(results):
        joins = res["join"]
        assert joins["last"] == 0, joins  # rank 0 joined last in round 1
        assert joins["last2"] == size - 1, joins  # and the last rank in round 2
        np.testing.assert_array_equal(joins["after"], [sum(range(1, size + 1))] * 2)
        if r == size - 1:
            continue
        total = sum(q + 1.0 for q in active)
        np.testing.assert_array_equal(joins["sum"], [total] * 3)
        np.testing.assert_allclose(joins["avg"], [total / size] * 3)  # divides by the full size
        np.testing.assert_array_equal(joins["int_avg"], [int(total) // size] * 3)
        np.testing.assert_array_equal(joins["cached"], [total] * 2)
        np.testing.assert_array_equal(joins["grouped"][0], [total] * 2)
        np.testing.assert_array_equal(joins["grouped"][1], [total])
        if r == 0:
            np.testing.assert_array_equal(joins["solo"], [10.0] * 3)
    for r in range(1, size):
        np.testing.assert_array_equal(results[r]["join"]["sum2"], [sum(q + 1.0 for q in range(1, size))] * 2)
    if size > 2:
        np.testing.assert_array_equal(results[size - 1]["join"]["solo2"], [1.0, 1.0])


def _load_timeline(path: str) -> tuple[list[dict], dict[str, int]]:
    with open(path) as handle:
        events = json.load(handle)
    pids = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
    return events, pids


def _spans(events: list[dict], pid: int) -> list[tuple[str, str]]:
    return [(e["ph"], e["name"]) for e in events if e.get("pid") == pid and e["ph"] in "BE"]


def _executed(events: list[dict], pids: dict[str, int]) -> set[str]:
    """Tensors with an operation span (not only negotiation) in the timeline."""
    names = {pid: name for name, pid in pids.items()}
    return {names[e["pid"]] for e in events
            if e["ph"] == "B" and not e["name"].startswith("NEGOTIATE_") and e.get("pid") in names}


def test_timeline_started_and_stopped_through_the_api(job):
    _, _, tmp = job
    events, pids = _load_timeline(f"{tmp}/api_timeline.json")
    # Only what ran between start and stop executed in it (another rank's early report of a later
    # tensor may still open a NEGOTIATE span just before stop_timeline: that is what happened).
    assert _executed(events, pids) == {"tl.api.allreduce", "tl.api.allgather"}
    for name, kind in (("tl.api.allreduce", "ALLREDUCE"), ("tl.api.allgather", "ALLGATHER")):
        spans = _spans(events, pids[name])
        for ph in "BE":
            assert (ph, f"NEGOTIATE_{kind}") in spans and (ph, kind) in spans


def test_timeline_from_environment_when_set(job):
    size, _, tmp = job
    path = f"{tmp}/env_timeline.json"
    if size != 2:  # HORA_TIMELINE is set for the 2-rank job only
        assert not os.path.exists(path)
        return
    events, pids = _load_timeline(path)
    # Rewritten by the init after shutdown: holds what ran after it, up to the API's start_timeline.
    assert "ar.float32.Sum" in pids and "grp.sum.0" in pids and "ag.f32" in pids
    assert "tl.api.allreduce" not in _executed(events, pids)  # switched to the API's timeline by then
    for name, kind in (("ar.float32.Sum", "ALLREDUCE"), ("ag.f32", "ALLGATHER"), ("bc.0", "BROADCAST"),
                       ("a2a.splits", "ALLTOALL"), ("rs.sum", "REDUCESCATTER")):
        spans = _spans(events, pids[name])
        assert ("B", f"NEGOTIATE_{kind}") in spans and ("E", kind) in spans, (name, spans)
