"""Shared memory's out-of-place allreduce (the public API's path for lone tensors): the same bits as
the in-segment allreduce, in place and out of place, across the pipeline's chunks and the segment
limit's windows, for 2 and 3 ranks (3: the summation order is not commutative-safe); with a
postscale, the bits of reducing and then scaling."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora

SIZES = (1, 7, 1000, 16385, 300_001, 1_100_003)  # across the small slots, one chunk, many, windows
DTYPES = ("float32", "float16", "float64", "int64")


def _worker() -> list[Any]:
    from hora.runtime import connect_world
    from hora.transport.base import ReduceOp
    from hora.transport.scaling import scale_into

    comm = connect_world("shm")
    bad: list[Any] = []
    try:
        for n in SIZES:
            for name in DTYPES:
                dtype = np.dtype(name)
                rng = np.random.default_rng(comm.rank * 7919 + n)
                x = (rng.standard_normal(n) * 50).astype(dtype)
                for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT):
                    ref = comm.allocate(x.nbytes).view(dtype)[:n]  # the in-segment path: today's bits
                    ref[...] = x
                    comm.allreduce(ref, op)
                    ref = ref.copy()
                    out = np.full_like(x, 3)
                    comm.allreduce_into(x, out, op)
                    inplace = x.copy()
                    comm.allreduce_into(inplace, inplace, op)
                    for label, got in (("out", out), ("inplace", inplace)):
                        if got.tobytes() != ref.tobytes():
                            bad.append((comm.rank, n, name, op.name, label))
                # Average's division folded into the copy out: the bits of reducing, then scaling.
                for factor in (1 / comm.size, 0.37):
                    ref = x.copy()
                    comm.allreduce(ref, ReduceOp.SUM)
                    scale_into(ref, factor, ref)
                    out = np.full_like(x, 3)
                    comm.allreduce_into(x, out, ReduceOp.SUM, factor)
                    inplace = x.copy()
                    comm.allreduce_into(inplace, inplace, ReduceOp.SUM, factor)
                    for label, got in (("out", out), ("inplace", inplace)):
                        if got.tobytes() != ref.tobytes():
                            bad.append((comm.rank, n, name, f"scaled {factor:g}", label))
        x = np.arange(10, dtype=np.float32)
        with pytest.raises(ValueError, match="output must match"):
            comm.allreduce_into(x, np.empty(9, np.float32))
    finally:
        comm.close()
    return bad


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [2, 3])
def test_allreduce_into_matches_in_segment_allreduce(ranks: int) -> None:
    # A 1 MiB segment limit: the largest float64 case runs in several windows of several chunks.
    results = hora.run(_worker, np=ranks, env={"HORA_SHM_SEGMENT_BYTES": str(1 << 20)})
    assert results == [[]] * ranks
