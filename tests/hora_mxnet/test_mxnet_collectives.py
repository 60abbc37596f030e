"""hora.mxnet's collectives on NDArrays, on 2 and 3 real workers, checked by value.

One job per world size (module-scoped) runs every check as a named section inside the MXNet venv
(mxnet_venv.py builds it once and caches it); the tests here read the results in the main
environment. The suite is dtype x op x shape for allreduce (plain, in place, async, grouped) and
dtype x shape for allgather, broadcast, alltoall and reducescatter.
"""

from __future__ import annotations

import numpy as np
import pytest
from mxnet_cases import DTYPES, SHAPES, gathered_rows, ops_for, reduced, value
from mxnet_job import run_job

pytestmark = pytest.mark.timeout(1200)  # the first test may build the MXNet venv (pip, once per cache)

CASES = [(d, s, o) for d in DTYPES for s in SHAPES for o in ops_for(d)]


@pytest.fixture(scope="module")
def jobs():
    return {n: run_job("collectives", n) for n in (2, 3)}


def _close(got, want, dtype):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if dtype in ("float16", "float32", "float64"):
        np.testing.assert_allclose(got, want, rtol=1e-3 if dtype == "float16" else 1e-6)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype,shape,op", CASES, ids=[f"{d}-{'x'.join(map(str, s))}-{o}" for d, s, o in CASES])
def test_allreduce(jobs, size, dtype, shape, op):
    want = reduced(dtype, shape, op, size)
    for r in range(size):
        got = jobs[size].get("allreduce", r)[dtype, shape, op]
        for form in ("plain", "inplace", "async"):
            _close(got[form], want, dtype)
        for g in got["grouped"]:
            _close(g, want, dtype)
        assert got["dtype"] == dtype
        np.testing.assert_array_equal(got["input_after"], value(dtype, shape, r))  # the input is not modified


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_allgather_broadcast_alltoall_reducescatter(jobs, size, dtype, shape):
    rows = np.concatenate([value(dtype, (gathered_rows(r),) + shape[1:], r) for r in range(size)])
    inputs = [value(dtype, shape, r) for r in range(size)]
    for r in range(size):
        got = jobs[size].get("others", r)[dtype, shape]
        _close(got["allgather"], rows, dtype)
        _close(got["grouped_allgather"][0], rows, dtype)
        _close(got["grouped_allgather"][1], np.concatenate(inputs), dtype)
        _close(got["broadcast"], inputs[-1], dtype)
        _close(got["broadcast_"], inputs[-1], dtype)
        if got["alltoall"] is not None:
            splits = [1] * (size - 1) + [shape[0] - (size - 1)]
            starts = np.cumsum([0] + splits)
            want = np.concatenate([inputs[src][starts[r]:starts[r + 1]] for src in range(size)])
            _close(got["alltoall"][0], want, dtype)
            np.testing.assert_array_equal(got["alltoall"][1], [splits[r]] * size)
        if dtype != "bool":
            blocks = np.array_split(np.arange(shape[0]), size)[r]  # earlier ranks take the remainder rows
            for op in ("Sum", "Average"):
                _close(got["reducescatter"][op], reduced(dtype, shape, op, size)[blocks], dtype)
            _close(got["grouped_reducescatter"][0], reduced(dtype, shape, "Sum", size)[blocks], dtype)


@pytest.mark.parametrize("size", [2, 3])
def test_arguments_as_horovod(jobs, size):
    n = size
    base = np.array([1.0, 2.0])
    total = base * sum(r + 1 for r in range(n))
    for r in range(n):
        got = jobs[size].get("arguments", r)
        np.testing.assert_allclose(got["scaled"], total * 2 * 0.25)
        np.testing.assert_allclose(got["average_false"], total)
        np.testing.assert_allclose(got["average_true"], total / n)
        np.testing.assert_allclose(got["default"], total / n)  # op=None means Average, as in Horovod
        np.testing.assert_allclose(got["priority"], total / n)
        assert got["priority_warned"]  # priority has no effect in hora, and says so
        assert got["empty_grouped"] == []
        np.testing.assert_array_equal(got["alltoall_equal"], [2 * r + i + 10 * s for s in range(n) for i in range(2)])
        assert got["objects"] == ({"from": n - 1}, [10 * k for k in range(n)])
        assert got["poll"] is True
        assert got["context"] == "cpu(0)"
        errors = got["errors"]
        assert errors["average_and_op"].startswith("ValueError")
        assert errors["bool_average"].startswith("TypeError")
        assert errors["not_ndarray"].startswith("TypeError") and "NDArray" in errors["not_ndarray"]
        assert errors["bad_root"].startswith("ValueError") and f"root_rank {n + 3}" in errors["bad_root"]
        # Horovod raises NotImplementedError; hora's UnsupportedOperationError is that and a ValueError.
        assert errors["reducescatter_max"].startswith("UnsupportedOperationError")
        assert {"NotImplementedError", "ValueError"} <= set(errors["reducescatter_max_bases"])


@pytest.mark.parametrize("size", [2, 3])
def test_bad_input_errors_on_every_rank_and_the_next_collective_works(jobs, size):
    for r in range(size):
        got = jobs[size].get("bad_input", r)
        for key in ("row_sparse", "csr", "sparse_in_group", "sparse_broadcast_"):
            assert got[key] is not None and got[key].startswith("ValueError"), (key, got[key])
            assert f"rank {r} on " in got[key] and "sparse" in got[key] and "tostype('default')" in got[key]
        assert "'csr'" in got["csr"] and "'row_sparse'" in got["row_sparse"]
        np.testing.assert_array_equal(got["after_sparse"], np.full((3, 2), float(size)))
        assert got["mismatch"].startswith("CollectivePreconditionError") and "mismatch" in got["mismatch"]
        assert "rank 0 has [2], rank 1 has [3]" in got["mismatch"]
        assert got["mismatch_dtype"].startswith("CollectivePreconditionError")
        np.testing.assert_array_equal(got["after_mismatch"], [float(size)] * 2)
        assert got["bf16"].startswith("UnsupportedOperationError: Compression.bf16: MXNet NDArrays have no "
                                      "bfloat16 type"), got["bf16"]
        assert got["optimizer_fp16"] == got["trainer_fp16"] == "FP16Compressor", got
        for key in ("optimizer_powersgd:4", "trainer_powersgd:4"):
            assert got[key].startswith("UnsupportedOperationError") and "HORA_COMPRESSION=powersgd:4" in got[key], got
