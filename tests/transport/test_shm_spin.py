"""Shared memory's adaptive spin: a wait spins longer (up to a bound) while the peers keep arriving
during the spin, halves its spin each time it runs out, and never spins past the minimum when the
group has more ranks than the machine has cores (a spinning rank would hold a core its peer needs)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora


def _worker() -> dict[str, Any]:
    import time

    from hora.runtime import connect_world
    from hora.transport import shm
    from hora.transport.base import ReduceOp

    comm = connect_world("shm")
    try:
        x = np.ones(4, np.float32)
        most = comm._spin_most
        expected_most = shm._SPIN_CHECKS_MAX if comm.size <= shm._usable_cores() else shm._SPIN_CHECKS_MIN
        # The last rank arrives 5 ms late to every allreduce: the others' spins run out each time.
        late = []
        for _ in range(12):
            if comm.rank == comm.size - 1:
                time.sleep(0.005)
            x[...] = 1
            comm.allreduce(x, ReduceOp.SUM)
            late.append(comm._spin_checks)
        # Then back to back: the spin grows again once the peers arrive during it.
        grew = False
        for _ in range(3000):
            x[...] = 1
            comm.allreduce(x, ReduceOp.SUM)
            grew = grew or comm._spin_checks > shm._SPIN_CHECKS_MIN
            assert shm._SPIN_CHECKS_MIN <= comm._spin_checks <= most
        return {"rank": comm.rank, "most_ok": most == expected_most, "late_floor": late[-1] == shm._SPIN_CHECKS_MIN,
                "grew": grew, "adapts": most > shm._SPIN_CHECKS_MIN, "sum": float(x[0])}
    finally:
        comm.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [2, 3])
def test_spin_adapts_within_its_bounds(ranks: int) -> None:
    results = hora.run(_worker, np=ranks)
    for got in results:
        assert got["most_ok"] and got["sum"] == float(ranks), got
        if got["rank"] != ranks - 1:  # (the late rank itself finds its peers waiting: nothing to cut)
            assert got["late_floor"], got
            if got["adapts"]:  # cut to the minimum, then grown again by catching its peers
                assert got["grew"], got
