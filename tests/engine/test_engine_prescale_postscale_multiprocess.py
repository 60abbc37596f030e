"""Prescale and postscale factors on 2 real ranks give Horovod's numbers bit for bit.

Horovod scales each element in the tensor's own dtype: float16 through float32 (the factor is
rounded to float32, the product rounded back to float16), float32 in float32, float64 in float64,
and integers in float64 with the result truncated toward zero. It scales every rank's input before
the reduction and the reduced result after it; Average is a Sum whose postscale factor is divided
by the number of ranks. The reference below implements that rule independently of hora's code, and
each rank's input differs, so a factor applied at the wrong point shows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora

pytestmark = pytest.mark.timeout(180)

DTYPES = ("int32", "int64", "float16", "float32", "float64")
DIMS = (1, 2, 3)
#: (prescale, postscale): a factor that is not exact in float16, one that is, and both at once.
FACTORS = ((0.1915194503788923, 1.0), (1.0, 0.1915194503788923), (2.5, 0.3), (1.0, 1.0))
SIZE = 2


def horovod_scale(x: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's element-wise scaling of one buffer (what its CPU ops do), written out here."""
    if factor == 1.0:
        return x.copy()
    if x.dtype.kind in "iu":
        return (x.astype(np.float64) * factor).astype(x.dtype)
    if x.dtype == np.float16:
        return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return x * x.dtype.type(factor)


def rank_input(rank: int, dtype: str, dim: int, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1234 + 100 * salt + rank)
    return rng.integers(-100, 100, size=(SIZE * 4,) * dim).astype(dtype)


def expected(dtype: str, dim: int, salt: int, pre: float, post: float, average: bool) -> np.ndarray:
    scaled = [horovod_scale(rank_input(r, dtype, dim, salt), pre) for r in range(SIZE)]
    total = scaled[0] + scaled[1]
    return horovod_scale(total, post / SIZE if average else post)


def _job() -> dict[str, Any]:
    hora.init()
    r = hora.rank()
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        for dim in DIMS:
            for k, (pre, post) in enumerate(FACTORS):
                for op_name, op in (("Sum", hora.Sum), ("Average", hora.Average)):
                    key = f"{dtype}/{dim}/{k}/{op_name}"
                    t = rank_input(r, dtype, dim, 0)
                    out["rs/" + key] = hora.reducescatter(t, op=op, prescale_factor=pre, postscale_factor=post)
                    group = [rank_input(r, dtype, dim, s) for s in range(5)]
                    out["grs/" + key] = hora.grouped_reducescatter(group, op=op, prescale_factor=pre,
                                                                   postscale_factor=post)
                    out["ar/" + key] = hora.allreduce(t, op=op, prescale_factor=pre, postscale_factor=post)
                    out["gar/" + key] = hora.grouped_allreduce(group, op=op, prescale_factor=pre,
                                                               postscale_factor=post)
    hora.barrier()  # the job is still healthy afterwards
    out["after"] = hora.allreduce(np.ones(3), op=hora.Sum)
    hora.shutdown()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return hora.run(_job, np=SIZE, env={"HORA_STALL_CHECK_TIME_SECONDS": "30",
                                        "HORA_STALL_SHUTDOWN_TIME_SECONDS": "60"})


def _cases():
    for dtype in DTYPES:
        for dim in DIMS:
            for k in range(len(FACTORS)):
                for op_name in ("Sum", "Average"):
                    yield pytest.param(dtype, dim, k, op_name, id=f"{dtype}-dim{dim}-factors{k}-{op_name}")


def _assert_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:5]
        raise AssertionError(f"{what}: {len(bad)}+ elements differ, e.g. at {bad.tolist()}: "
                             f"got {got.reshape(-1)[bad].tolist()}, want {want.reshape(-1)[bad].tolist()}")


@pytest.mark.parametrize("dtype,dim,k,op_name", list(_cases()))
def test_scaled_reducescatter_and_allreduce_match_horovod_bit_for_bit_2ranks(results, dtype, dim, k, op_name):
    pre, post = FACTORS[k]
    average = op_name == "Average"
    key = f"{dtype}/{dim}/{k}/{op_name}"
    for r in range(SIZE):
        rows = slice(4 * r, 4 * (r + 1))
        _assert_bits(results[r]["rs/" + key], expected(dtype, dim, 0, pre, post, average)[rows],
                     f"reducescatter on rank {r}")
        for s, got in enumerate(results[r]["grs/" + key]):
            _assert_bits(got, expected(dtype, dim, s, pre, post, average)[rows],
                         f"grouped_reducescatter member {s} on rank {r}")
        _assert_bits(results[r]["ar/" + key], expected(dtype, dim, 0, pre, post, average), f"allreduce on rank {r}")
        for s, got in enumerate(results[r]["gar/" + key]):
            _assert_bits(got, expected(dtype, dim, s, pre, post, average),
                         f"grouped_allreduce member {s} on rank {r}")


def test_collectives_still_work_after_the_scaled_ones_2ranks(results):
    for r in range(SIZE):
        assert results[r]["after"].tolist() == [2.0, 2.0, 2.0]
