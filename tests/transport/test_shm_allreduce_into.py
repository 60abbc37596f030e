"""Shared memory's out-of-place allreduce (the public API's path for lone tensors): the same bits as
the in-segment allreduce, in place and out of place, across the pipeline's chunks, its ring of slots
(once a pipeline outgrows it) and the segment limit's windows, for 2 and 3 ranks (3: the summation
order is not commutative-safe); with a postscale, the bits of reducing and then scaling."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora

SIZES = (1, 7, 1000, 16385, 300_001, 1_100_003)  # across the small slots, one chunk, many, windows
DTYPES = ("float32", "float16", "float64", "int64")


def _worker(sizes: tuple[int, ...] = SIZES, dtypes: tuple[str, ...] = DTYPES,
            pipeline: tuple[int, int] | None = None, slow_rank: int | None = None) -> list[Any]:
    import time

    from hora.runtime import connect_world
    from hora.transport import shm
    from hora.transport.base import ReduceOp
    from hora.transport.scaling import scale_into

    if pipeline is not None:  # (chunk bytes, ring slots): the same on every rank
        shm._PIPELINE_BYTES, shm._PIPELINE_RING = pipeline
    comm = connect_world("shm")
    if comm.rank == slow_rank:  # late to every copy out: peers must not refill a slot it still reads
        fast = shm.scale_into

        def late(*args: Any) -> None:
            time.sleep(0.001)
            fast(*args)

        shm.scale_into = late
    bad: list[Any] = []
    try:
        for n in sizes:
            for name in dtypes:
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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [2, 3])
def test_allreduce_into_through_the_ring(ranks: int) -> None:
    # 4 KiB chunks and the smallest legal ring (3 slots): 16385 float64 elements run in 33 chunks,
    # so every slot is refilled ten times; 1000 elements (2 chunks) fit in the ring without wrapping.
    small = hora.run(_worker, args=((1000, 16385, 300_001), DTYPES, (4096, 3)), np=ranks)
    assert small == [[]] * ranks
    # The last rank late to each copy out: the others refill slots as early as the protocol lets
    # them (with a ring of 2 slots, that is while the late rank still reads them).
    late = hora.run(_worker, args=((16385,), ("float32",), (4096, 3), ranks - 1), np=ranks)
    assert late == [[]] * ranks
    # The shipped chunk and ring: 3.4 M float32 elements (13.6 MB) take 7 chunks of 2 MiB (2 ranks),
    # one more than the ring holds.
    shipped = hora.run(_worker, args=((3_400_001,), ("float32",)), np=ranks)
    assert shipped == [[]] * ranks
