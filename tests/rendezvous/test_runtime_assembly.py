"""What init() assembles in real workers: the world's and process sets' transports (world size 3)."""

from __future__ import annotations

import numpy as np
import pytest

import hora

pytestmark = pytest.mark.timeout(120)


def transports_of_world_and_set():
    from hora import basics

    hora.init()
    try:
        pair = hora.add_process_set([0, 1])
        engine = basics.engine()
        world_kind = type(basics._ctx.runtime.world).__name__
        set_kind = type(engine._sets[pair.process_set_id].comm).__name__ if pair.included() else None
        total = hora.allreduce(np.array([1.0]), op=hora.Sum, name="in_set", process_set=pair) \
            if pair.included() else None
        hora.barrier()
        return world_kind, set_kind, None if total is None else float(total[0])
    finally:
        hora.shutdown()


@pytest.mark.parametrize("transport, expected", [("auto", "ShmCommunicator"), ("tcp", "TcpCommunicator")])
def test_a_process_set_gets_the_transport_world_formation_chooses_world_size_3(transport, expected):
    results = hora.run(transports_of_world_and_set, np=3, start_timeout=60, env={"HORA_TRANSPORT": transport})
    assert results == [(expected, expected, 2.0), (expected, expected, 2.0), (expected, None, None)]
