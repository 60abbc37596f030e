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


def _job_environment(monkeypatch, server, secret: str, job_id: str) -> None:
    """This process as rank 0 of a one-rank job whose store is ``server``."""
    import os

    for key in list(os.environ):
        if key.startswith(("HORA_", "HOROVOD_")):
            monkeypatch.delenv(key)
    values = {"RANK": 0, "SIZE": 1, "LOCAL_RANK": 0, "LOCAL_SIZE": 1, "CROSS_RANK": 0, "CROSS_SIZE": 1,
              "HOSTNAME": "localhost", "RENDEZVOUS_ADDR": server.host, "RENDEZVOUS_PORT": server.port,
              "SECRET": secret, "JOB_ID": job_id}
    for name, value in values.items():
        monkeypatch.setenv(f"HORA_{name}", str(value))


def test_init_after_shutdown_joins_the_next_round_of_the_same_job_and_round_0_of_another(monkeypatch):
    from hora import basics
    from hora.rendezvous import RendezvousServer, new_secret

    first_secret, second_secret = new_secret(), new_secret()
    with RendezvousServer(first_secret) as first, RendezvousServer(second_secret) as second:
        try:
            basics.reset()
            _job_environment(monkeypatch, first, first_secret, "first-job")
            hora.init()
            hora.shutdown()
            hora.init()
            assert basics._ctx.runtime.round.generation == 1
            assert first.store.keys("round/0/") == [] and first.store.keys("round/1/") != []
            hora.shutdown()
            _job_environment(monkeypatch, second, second_secret, "second-job")
            hora.init()
            assert basics._ctx.runtime.round.generation == 0 and hora.size() == 1
        finally:
            basics.reset()
