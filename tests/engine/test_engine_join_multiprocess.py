"""A collective other than allreduce, called while another rank has joined, fails at once on the
ranks that called it, and the job carries on after everyone has joined (2 real ranks).

Joining is uneven by nature: the ranks that have not joined call collectives the joined ones never
call. The unnamed collectives after the join must still pair up across ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora

pytestmark = pytest.mark.timeout(120)


def _error(call) -> dict[str, Any] | None:
    try:
        call()
    except Exception as exc:  # the test reads the type and message
        return {"type": type(exc).__name__, "runtime": isinstance(exc, RuntimeError), "message": str(exc)}
    return None


def _job() -> dict[str, Any]:
    hora.init()
    r = hora.rank()
    out: dict[str, Any] = {}
    if r == 0:
        out["join"] = hora.join()
    else:
        out["allgather"] = _error(lambda: hora.allgather(np.ones(2)))
        out["broadcast"] = _error(lambda: hora.broadcast(np.ones(2), 1))
        out["reducescatter"] = _error(lambda: hora.reducescatter(np.ones(4), op=hora.Sum))
        out["alltoall"] = _error(lambda: hora.alltoall(np.ones(2)))
        out["allreduce"] = hora.allreduce(np.full(2, 4.0), op=hora.Sum)  # joined rank adds zeros
        out["join"] = hora.join()
    # Everyone has joined: the job goes on, unnamed collectives included.
    out["allgather_object"] = hora.allgather_object({"rank": r})
    out["broadcast_object"] = hora.broadcast_object(f"from {r}", root_rank=1)
    out["allgather_after"] = hora.allgather(np.full(1, r))
    out["allreduce_after"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum)
    hora.barrier()
    hora.shutdown()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    # A stall (unnamed collectives out of step across ranks) fails the job instead of hanging it.
    return hora.run(_job, np=2, env={"HORA_STALL_CHECK_TIME_SECONDS": "5",
                                     "HORA_STALL_SHUTDOWN_TIME_SECONDS": "20"})


@pytest.mark.parametrize("op", ["allgather", "broadcast", "reducescatter", "alltoall"])
def test_collective_while_a_rank_has_joined_raises_naming_the_op_and_the_join_2ranks(results, op):
    error = results[1][op]
    assert error is not None, f"{op} while rank 0 has joined must raise"
    assert error["runtime"], error
    message = error["message"].lower()
    assert op in message and "joined" in message and "[0]" in message, error["message"]


def test_allreduce_while_a_rank_has_joined_counts_it_as_zeros_2ranks(results):
    assert results[1]["allreduce"].tolist() == [4.0, 4.0]
    assert [results[r]["join"] for r in range(2)] == [1, 1]  # rank 1 joined last


def test_job_carries_on_after_everyone_joined_2ranks(results):
    for r in range(2):
        got = results[r]
        assert got["allgather_object"] == [{"rank": 0}, {"rank": 1}]
        assert got["broadcast_object"] == "from 1"
        assert got["allgather_after"].tolist() == [0, 1]
        assert got["allreduce_after"].tolist() == [3.0, 3.0]
