"""op=Adasum through hora's public API on real multi-process jobs, against a plain NumPy reference.

One job per world size and transport (2 ranks on shared memory, 3 on shared memory and on TCP, 2+2
and 2+1 on two emulated hosts): every section computes on every rank, and the test checks
each rank's result against ``adasum_reference.tree`` of all ranks' inputs (regenerated here from the
same seeds). The host jobs run on two emulated hosts (``HORA_HOST_ID``; 2+2 and 2+1 ranks) with
hierarchical allreduce on, so it checks hierarchical Adasum (host averages, Adasum across hosts) and,
with the hierarchy switched off at the same point on every rank, the flat 4-rank tree.
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from adasum_reference import hierarchical, rank_input, tree
from sections import JOB_ENV, JobResults, run_job, run_sections

import hora

pytestmark = pytest.mark.timeout(180)

DTYPES = ("float16", "float32", "float64")
SHAPES = {"vector": (1001,), "matrix": (7, 5), "one": (1,)}
# Results agree with the reference to the last bit or so: only the summation order of the float64 dot
# products differs (the tree sums per-rank partial dot products), which moves a coefficient by an ulp.
TOL = {"float16": dict(rtol=2e-3, atol=2e-3), "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
       "float32": dict(rtol=2e-6, atol=1e-6), "float64": dict(rtol=1e-12, atol=1e-12)}


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _sections() -> list[tuple[str, Any]]:
    r = hora.rank()
    sections = [("transport", lambda: type(hora.basics.engine().world).__name__)]

    def single(dtype: str):
        return lambda: {k: hora.allreduce(rank_input(r, shape, _dtype(dtype)), op=hora.Adasum, name=f"s.{dtype}.{k}")
                        for k, shape in SHAPES.items()}
    for dtype in DTYPES + ("bfloat16",):
        sections.append((f"single.{dtype}", single(dtype)))

    def fused():
        # Submitted together, so the engine fuses them into one buffer: each keeps its own coefficients.
        handles = {k: hora.allreduce_async(rank_input(r, shape, np.float32, seed=5), op=hora.Adasum, name=f"f.{k}")
                   for k, shape in SHAPES.items()}
        return {k: hora.synchronize(h) for k, h in handles.items()}

    def grouped():
        tensors = [rank_input(r, shape, np.float64, seed=9) for shape in SHAPES.values()]
        return hora.grouped_allreduce(tensors, op=hora.Adasum, name="grouped")

    def in_place():
        buf = rank_input(r, (64,), np.float32, seed=3)
        out = hora.allreduce_(buf, op=hora.Adasum, name="inplace")
        return out is buf, buf

    def scaled():
        x = rank_input(r, (50,), np.float64, seed=4)
        return hora.allreduce(x, op=hora.Adasum, prescale_factor=0.5, postscale_factor=3.0, name="scaled")

    def zero_on_rank_0():  # a zero vector (a joined rank's share) leaves the other side unchanged
        x = np.zeros(20) if r == 0 else rank_input(r, (20,), np.float64, seed=6)
        return hora.allreduce(x, op=hora.Adasum, name="zero")

    def errors():
        out = {}
        for label, call in [("int", lambda: hora.allreduce(np.arange(4, dtype=np.int32), op=hora.Adasum)),
                            ("bool", lambda: hora.allreduce(np.ones(2, bool), op=hora.Adasum)),
                            ("reducescatter", lambda: hora.reducescatter(np.ones(4), op=hora.Adasum))]:
            try:
                call()
                out[label] = None
            except Exception as exc:  # type and message are checked
                out[label] = f"{type(exc).__name__}: {exc}"
        return out

    def process_set():  # the first and the last rank only (with 2 ranks, that is the global set)
        ps = hora.add_process_set([0, hora.size() - 1]) if hora.size() > 2 else hora.global_process_set
        try:
            if not ps.included():
                return None
            return hora.allreduce(rank_input(r, (30,), np.float64, seed=7), op=hora.Adasum, name="ps", process_set=ps)
        finally:
            if ps is not hora.global_process_set:
                hora.remove_process_set(ps)

    sections += [("process_set", process_set), ("fused", fused), ("grouped", grouped), ("in_place", in_place),
                 ("scaled", scaled), ("zero", zero_on_rank_0), ("errors", errors)]
    return sections


@pytest.fixture(scope="module", params=[(2, "shm"), (3, "shm"), (3, "tcp")], ids=lambda p: f"np{p[0]}-{p[1]}")
def job(request) -> JobResults:
    size, transport = request.param
    results = run_job(_sections, np=size, env={"HORA_TRANSPORT": transport})
    assert all(kind == f"{transport.capitalize()}Communicator" for kind in results.all("transport")), \
        results.all("transport")
    return results


def _inputs(n: int, shape, dtype, seed: int = 0) -> list[np.ndarray]:
    return [rank_input(r, shape, dtype, seed) for r in range(n)]


def _check(results: list[np.ndarray], expected: np.ndarray, dtype: str) -> None:
    for rank, got in enumerate(results):
        assert got.dtype == expected.dtype and got.shape == expected.shape, (rank, got.dtype, got.shape)
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), **TOL[dtype],
                                   err_msg=f"rank {rank}")
    for rank, got in enumerate(results[1:], 1):  # every rank holds the very same bits
        np.testing.assert_array_equal(got, results[0], err_msg=f"rank {rank} differs from rank 0")


@pytest.mark.parametrize("dtype", DTYPES + ("bfloat16",))
def test_adasum_allreduce_matches_numpy_reference(job: JobResults, dtype: str) -> None:
    got = job.all(f"single.{dtype}")
    for key, shape in SHAPES.items():
        expected = tree(_inputs(job.size, shape, _dtype(dtype)))
        _check([g[key] for g in got], expected, dtype)


def test_adasum_fused_tensors_keep_their_own_coefficients(job: JobResults) -> None:
    got = job.all("fused")
    for key, shape in SHAPES.items():
        _check([g[key] for g in got], tree(_inputs(job.size, shape, np.float32, seed=5)), "float32")


def test_adasum_grouped_allreduce(job: JobResults) -> None:
    got = job.all("grouped")
    for i, shape in enumerate(SHAPES.values()):
        _check([g[i] for g in got], tree(_inputs(job.size, shape, np.float64, seed=9)), "float64")


def test_adasum_in_place_and_scale_factors(job: JobResults) -> None:
    in_place = job.all("in_place")
    assert all(same for same, _ in in_place)
    _check([buf for _, buf in in_place], tree(_inputs(job.size, (64,), np.float32, seed=3)), "float32")
    # Adasum is scale-equivariant: prescale and postscale multiply the result.
    expected = tree([0.5 * x for x in _inputs(job.size, (50,), np.float64, seed=4)]) * 3.0
    _check(job.all("scaled"), expected, "float64")
    zero_in = [np.zeros(20)] + _inputs(job.size, (20,), np.float64, seed=6)[1:]
    _check(job.all("zero"), tree(zero_in), "float64")


def test_adasum_on_a_process_set(job: JobResults) -> None:
    got = job.all("process_set")
    members = [0, job.size - 1]
    assert all(g is None for r, g in enumerate(got) if r not in members)
    _check([got[r] for r in members], tree([rank_input(r, (30,), np.float64, seed=7) for r in members]), "float64")


def test_adasum_bad_input_fails_on_every_rank_naming_it(job: JobResults) -> None:
    for rank, errors in enumerate(job.all("errors")):
        for label in ("int", "bool"):
            assert errors[label] and errors[label].startswith("TypeError: rank "), errors
            assert f"rank {rank}:" in errors[label] and "Adasum" in errors[label], errors[label]
        assert errors["reducescatter"] == (
            "UnsupportedOperationError: reducescatter: hora supports op=Average and op=Sum only")


# ---- two emulated hosts (2 + 2 and 2 + 1 ranks): hierarchical, then flat -------------------------

LAYOUTS = {"2+2": [[0, 1], [2, 3]], "2+1": [[0, 1], [2]]}


def _two_host_main() -> dict[str, Any]:
    rank = hora.config.get("rank")
    os.environ["HORA_HOST_ID"] = f"adasum-host-{rank // 2}"  # read by init(): two ranks per emulated host
    hora.init()
    try:
        world = hora.basics.engine().world

        def hier():
            return {"kind": type(world).__name__,
                    "values": {d: hora.allreduce(rank_input(rank, (333,), np.dtype(d)), op=hora.Adasum, name=f"h.{d}")
                               for d in DTYPES}}

        def flat():
            hora.barrier()
            world.use_hierarchy = False  # every rank, between the same two collectives
            return {d: hora.allreduce(rank_input(rank, (333,), np.dtype(d)), op=hora.Adasum, name=f"flat.{d}")
                    for d in DTYPES}
        return run_sections([("hierarchical", hier), ("flat", flat)])
    finally:
        hora.shutdown()


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def two_hosts(request) -> JobResults:
    env = {**JOB_ENV, "HORA_HIERARCHICAL_ALLREDUCE": "1"}
    results = JobResults(hora.run(_two_host_main, np=sum(map(len, LAYOUTS[request.param])), env=env))
    results.hosts = LAYOUTS[request.param]
    return results


@pytest.mark.parametrize("dtype", DTYPES)
def test_adasum_hierarchical_two_hosts(two_hosts: JobResults, dtype: str) -> None:
    got = two_hosts.all("hierarchical")
    assert all(g["kind"] == "HierarchicalCommunicator" for g in got), [g["kind"] for g in got]
    inputs = _inputs(two_hosts.size, (333,), np.dtype(dtype))
    _check([g["values"][dtype] for g in got], hierarchical(inputs, two_hosts.hosts), dtype)
    # Not the flat tree: the hosts' ranks were averaged, not Adasum-combined.
    assert not np.allclose(got[0]["values"][dtype].astype(np.float64), tree(inputs).astype(np.float64),
                           rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adasum_flat_with_the_hierarchy_switched_off(two_hosts: JobResults, dtype: str) -> None:
    _check([g[dtype] for g in two_hosts.all("flat")], tree(_inputs(two_hosts.size, (333,), np.dtype(dtype))), dtype)
