"""hora.bytes_sent(): the transports' own count of the bytes a rank sent, through the public API.

Over TCP a ring allreduce of N bytes among n ranks sends 2(n-1)/n N bytes from each rank ((n-1)/n of
the buffer while reducing, as much again while gathering back), so the counter must grow by that,
negotiation included; an allgather sends this rank's block on to the n-1 others. Through shared
memory the same collectives move no network bytes. The counter never goes back, not even when a
process set (and its communicator) is removed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora

N_BYTES = 4 << 20  # float32: well past the small-message path, so the pipelined ring runs


def _worker() -> dict[str, Any]:
    hora.init()
    try:
        out: dict[str, Any] = {"start": hora.bytes_sent()}
        buf = np.ones(N_BYTES // 4, dtype=np.float32)
        before = hora.bytes_sent()
        hora.allreduce_(buf, name="bytes.allreduce", op=hora.Sum)
        out["allreduce"] = hora.bytes_sent() - before
        out["sum_ok"] = bool((buf == hora.size()).all())
        before = hora.bytes_sent()
        hora.allgather(np.ones(N_BYTES // 8, dtype=np.float32), name="bytes.allgather")
        out["allgather"] = hora.bytes_sent() - before
        before = hora.bytes_sent()
        pair = hora.add_process_set([0, 1])
        if hora.rank() in pair.ranks:
            hora.allreduce(np.ones(N_BYTES // 4, dtype=np.float32), name="bytes.set", process_set=pair)
        with_set = hora.bytes_sent()
        hora.remove_process_set(pair)
        out["set"] = with_set - before
        out["after_removal"] = hora.bytes_sent() - with_set
        return out
    finally:
        hora.shutdown()


@pytest.mark.timeout(120)
def test_tcp_counts_what_each_collective_sends() -> None:
    n = 3
    results = hora.run(_worker, np=n, env={"HORA_TRANSPORT": "tcp"})
    ring = 2 * (n - 1) * N_BYTES // n
    for r, out in enumerate(results):
        assert out["sum_ok"], r
        assert isinstance(out["start"], int) and out["start"] >= 0
        # the ring's bytes, plus at most the negotiation's few messages
        assert ring <= out["allreduce"] <= ring + (64 << 10), (r, out)
        assert (n - 1) * N_BYTES // 2 <= out["allgather"] <= (n - 1) * N_BYTES // 2 + (64 << 10), (r, out)
        if r in (0, 1):  # a process set's own communicator counts too: a 2-rank ring of N bytes
            assert out["set"] >= N_BYTES, (r, out)
        assert out["after_removal"] >= 0, (r, out)  # removing the set takes nothing back


@pytest.mark.timeout(120)
def test_shared_memory_moves_no_network_bytes() -> None:
    results = hora.run(_worker, np=3, env={"HORA_TRANSPORT": "shm"})
    for r, out in enumerate(results):
        assert out["sum_ok"], r
        assert 0 <= out["allreduce"] < (64 << 10) and 0 <= out["allgather"] < (64 << 10), (r, out)
        assert out["after_removal"] >= 0, (r, out)


def test_bytes_sent_needs_init() -> None:
    with pytest.raises(ValueError, match="init"):
        hora.bytes_sent()
