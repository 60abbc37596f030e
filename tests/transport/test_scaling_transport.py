"""The transports at 16 ranks on one host: the conformance subset, connections that grow with
log2(ranks) rather than with the job, and a kill -9 of one rank that every survivor names.

Each world is one job shared by its tests (module-scoped), as in test_conformance.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hora
from hora import config

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from conformance_cases import conformance_worker  # noqa: E402
from scaling_cases import at_scale, scale_cases  # noqa: E402
from test_conformance import thresholds  # noqa: E402
from test_peer_failure import DETECT_LIMIT_S, _dying_rank_worker, _names_rank  # noqa: E402

SCALE = 16
# 16 processes on CI's 2 cores: a rank may wait on a descheduled peer for seconds; generous, but a
# desynchronised job still fails well inside the test's time-out.
SCALE_TRANSPORT_TIMEOUT_S = 60
# Built-in transports, and the emulated host layout for the one that cares where ranks run.
SCALE_WORLDS = {"tcp": (), "shm": (), "hierarchical": (4, 4, 4, 4)}
_JOBS: dict[str, Any] = {}


def _knobs() -> dict[str, int]:
    return thresholds(config.environ_copy())


def _scale_job(transport: str) -> list[dict[str, Any]] | BaseException:
    if transport not in _JOBS:
        try:
            _JOBS[transport] = hora.run(
                conformance_worker, args=(transport, _knobs(), SCALE_WORLDS[transport], at_scale), np=SCALE,
                env={"HORA_TRANSPORT_TIMEOUT": str(SCALE_TRANSPORT_TIMEOUT_S)})
        except Exception as exc:  # every case of this world reports it
            _JOBS[transport] = exc
    return _JOBS[transport]


def _params() -> list[Any]:
    return [pytest.param(t, c.id, id=f"{t}-np{SCALE}-{c.id}")
            for t in SCALE_WORLDS for c in scale_cases(SCALE, **_knobs())]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("transport", "case_id"), _params())
def test_conformance_at_16_ranks(transport: str, case_id: str) -> None:
    results = _scale_job(transport)
    if isinstance(results, BaseException):
        pytest.fail(f"the {SCALE}-rank {transport} job failed: {type(results).__name__}: {results}")
    assert "__unavailable__" not in results[0], results[0]
    digests = set()
    for rank, report in enumerate(results):
        ok, detail, digest = report[case_id]
        assert ok, f"rank {rank}: {detail}"
        digests.add(digest)
    assert len(digests) == 1, f"ranks hold different results: {digests}"


# ---- connections grow with log2(ranks) ----------------------------------------------------------


def _open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _steady_state_worker() -> dict[str, Any]:
    """What a training job does every step, through the engine and through a bare TCP world."""
    from hora.runtime import connect_world

    hora.init()
    try:
        for step in range(5):
            hora.allreduce(np.ones(4, np.float32), name="small")
            hora.allreduce(np.ones(300_000, np.float32), name="large")
            hora.broadcast(np.ones(8, np.float32), root_rank=0, name="bcast")
            hora.allgather_object({"step": step})
            hora.barrier()
        engine_sockets = _open_sockets()
        tcp = connect_world("tcp")
        try:
            for _ in range(3):
                buf = np.ones(4, np.float32)
                tcp.allreduce(buf)
                assert float(buf[0]) == tcp.size
                tcp.allreduce(np.ones(300_000, np.float32))
                tcp.broadcast(np.ones(8, np.float32), 0)
                tcp.broadcast_object("x", 0)
                tcp.gather_object(tcp.rank, 0)
                tcp.barrier()
            peers = tcp.connected_peers()
        finally:
            tcp.close()
        return {"engine_sockets": engine_sockets, "tcp_peers": peers}
    finally:
        hora.shutdown()


@pytest.fixture(scope="module")
def steady_state() -> dict[int, list[dict[str, Any]]]:
    return {n: hora.run(_steady_state_worker, np=n, env={"HORA_TRANSPORT_TIMEOUT": "60"}) for n in (4, SCALE)}


@pytest.mark.timeout(400)
def test_tcp_peers_grow_with_log2_ranks(steady_state: dict[int, list[dict[str, Any]]]) -> None:
    """Ring neighbours plus recursive-doubling / binomial-tree partners: at most 2 log2(n) peers."""
    for n, reports in steady_state.items():
        bound = 2 * math.ceil(math.log2(n))
        for rank, report in enumerate(reports):
            assert len(report["tcp_peers"]) <= min(n - 1, bound), (n, rank, report["tcp_peers"])
    assert max(len(r["tcp_peers"]) for r in steady_state[SCALE]) < SCALE - 1


@pytest.mark.timeout(400)
def test_sockets_per_process_grow_at_most_logarithmically(steady_state: dict[int, list[dict[str, Any]]]) -> None:
    """Four times the ranks may add at most 2 log2(4) sockets per process, not 12."""
    small = max(r["engine_sockets"] for r in steady_state[4])
    large = max(r["engine_sockets"] for r in steady_state[SCALE])
    assert large - small <= 2 * math.log2(SCALE / 4), (small, large)


# ---- a kill -9 at 16 ranks ---------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_kill_9_of_one_in_16_fails_every_survivor_naming_it(transport: str) -> None:
    """Rank 7's only direct partners are a few ranks; everyone else learns of it through the tree
    and the abort record, and all name rank 7 within the detection limit."""
    victim = 7
    results = hora.run(_dying_rank_worker, args=(victim, "sigkill", 16, 20, transport), np=SCALE,
                       env={"HORA_TRANSPORT_TIMEOUT": "30"})
    assert results[victim]["child_status"] == -signal.SIGKILL, results[victim]
    for report in results:
        if report["rank"] == victim:
            continue
        assert report["raised"], f"rank {report['rank']}: {report['message']}"
        assert report["is_peer_failure"] and report["is_internal"], report
        assert _names_rank(report["message"], victim), report
        assert report["failed_rank"] == victim, report
        assert report["seconds_since_last_ok"] < DETECT_LIMIT_S, report
