"""hora.elastic.run on real 2-rank jobs: a failed collective rolls every rank back to its last commit,
a host change announced in the store interrupts every rank at the same commit, and either way the
world is re-formed as the next rendezvous round inside the same processes.

No elastic driver exists yet, so each reset here is one that every rank sees: all ranks raise
HorovodInternalError at the same step, or rank 0 writes the announcement key itself.

The failed collective, the two host updates and the reset limit run one after the other in one job
(sections.py): each job costs two worker start-ups. They count rendezvous rounds from the one they
start in, and the job sets HORA_ELASTIC_RESET_LIMIT=2 for the last of them (the others reset once).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest
from sections import JobResults, run_job
from shared_jobs import Sections, announce_host_change, generation

import hora
import hora.elastic
from hora.errors import HorovodInternalError

pytestmark = pytest.mark.timeout(240)

JOB_ENV = {"HORA_STALL_SHUTDOWN_TIME_SECONDS": "45", "HORA_STALL_CHECK_TIME_SECONDS": "20"}


class CountingState(hora.elastic.ObjectState):
    """An ObjectState that counts its syncs and restores (plain attributes, not part of the state)."""

    def __init__(self, **kwargs: Any) -> None:
        self.syncs = 0
        self.restores = 0
        super().__init__(**kwargs)

    def sync(self) -> None:
        self.syncs += 1
        super().sync()

    def restore(self) -> None:
        self.restores += 1
        super().restore()


def _entry(state: CountingState, start: int) -> dict[str, Any]:
    """What one call of the training function starts from (generations counted from ``start``)."""
    return {"pid": os.getpid(), "generation": generation() - start, "rank": hora.rank(), "size": hora.size(),
            "step": state.step, "history": list(state.history), "seed": state.seed}


def _sections() -> Sections:
    return [("collective_failure", _collective_failure), ("hosts_update.with_sync", lambda: _hosts_update(False)),
            ("hosts_update.skip_sync", lambda: _hosts_update(True)), ("reset_limit", _always_failing)]


@pytest.fixture(scope="module")
def job() -> JobResults:
    return run_job(_sections, np=2, env={**JOB_ENV, "HORA_ELASTIC_RESET_LIMIT": "2"})


def _collective_failure() -> dict[str, Any]:
    start = generation()
    calls: list[dict[str, Any]] = []
    failed = {"done": False}
    # Rank 1 starts from a different seed: the first sync must give it rank 0's.
    state = CountingState(step=0, history=[], seed=100 + hora.rank())
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hora.size())])

    @hora.elastic.run
    def train(state: CountingState) -> dict[str, Any]:
        calls.append(_entry(state, start))
        while state.step < 6:
            total = hora.allreduce(np.array([float(state.step)]), op=hora.Sum, name=f"step.{state.step}")
            state.history.append((state.step, float(total[0])))
            state.step += 1
            if state.step == 2:
                state.commit()
            if state.step == 4 and not failed["done"]:
                failed["done"] = True  # every rank fails here, after two uncommitted steps
                raise HorovodInternalError("a peer failed (simulated on every rank)")
        return {"final_step": state.step, "history": list(state.history)}

    out = train(state)
    out.update(calls=calls, resets=resets, syncs=state.syncs, restores=state.restores,
               after=float(hora.allreduce(np.array([hora.rank() + 1.0]), op=hora.Sum, name="after")[0]))
    return out


def test_a_collective_failure_on_every_rank_restores_the_last_commit_and_reforms_the_world_in_place_world_size_2(
        job: JobResults):
    results = job.all("collective_failure")
    for rank, out in enumerate(results):
        first, second = out["calls"]
        assert first["pid"] == second["pid"], "the worker was restarted instead of re-forming in place"
        assert (first["generation"], second["generation"]) == (0, 1)
        assert first["seed"] == 100 and second["seed"] == 100, "the first sync gives every rank rank 0's state"
        # the second call starts from the commit at step 2, not from the uncommitted steps 2 and 3
        assert second["step"] == 2 and second["history"] == [(0, 0.0), (1, 2.0)]
        assert second["rank"] == rank and second["size"] == 2
        assert out["final_step"] == 6
        assert [s for s, _ in out["history"]] == [0, 1, 2, 3, 4, 5], "no committed step lost or repeated"
        assert [t for _, t in out["history"]] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        assert out["restores"] == 1 and out["syncs"] == 2 and out["resets"] == [2]
        assert out["after"] == 3.0
    assert results[0]["calls"][0]["pid"] != results[1]["calls"][0]["pid"]


def _hosts_update(skip_sync: bool) -> dict[str, Any]:
    start = generation()
    calls: list[dict[str, Any]] = []
    interrupted_at: list[int] = []
    state = CountingState(step=0, history=[], seed=7)

    @hora.elastic.run
    def train(state: CountingState) -> dict[str, Any]:
        calls.append(_entry(state, start))
        while state.step < 5:
            hora.allreduce(np.array([1.0]), op=hora.Sum, name=f"step.{state.step}")
            state.history.append(state.step)
            state.step += 1
            if state.step == 3 and hora.rank() == 0 and generation() == start:
                # Only rank 0 sees the announcement being written; the commit's agreement makes
                # rank 1 stop at the same commit even if it read the key before this write.
                announce_host_change(skip_sync=skip_sync)
            try:
                state.commit()
            except hora.HostsUpdatedInterrupt:
                interrupted_at.append(state.step)
                raise
        return {"final_step": state.step, "history": list(state.history)}

    out = train(state)
    out.update(calls=calls, interrupted_at=interrupted_at, syncs=state.syncs, restores=state.restores)
    return out


@pytest.mark.parametrize("skip_sync", [False, True], ids=["with_sync", "skip_sync"])
def test_a_hosts_update_in_the_store_interrupts_every_rank_at_the_same_commit_and_keeps_the_state_world_size_2(
        job: JobResults, skip_sync: bool):
    results = job.all("hosts_update.skip_sync" if skip_sync else "hosts_update.with_sync")
    for out in results:
        assert out["interrupted_at"] == [3], "every rank is interrupted at the commit of step 3, once"
        first, second = out["calls"]
        assert first["pid"] == second["pid"] and (first["generation"], second["generation"]) == (0, 1)
        assert second["step"] == 3 and second["history"] == [0, 1, 2], "the committed state is kept"
        assert out["restores"] == 0
        assert out["syncs"] == (1 if skip_sync else 2)
        assert out["final_step"] == 5 and out["history"] == [0, 1, 2, 3, 4]


def _always_failing() -> dict[str, Any]:
    start = generation()
    generations: list[int] = []
    state = hora.elastic.ObjectState(step=0)

    @hora.elastic.run
    def train(state: hora.elastic.ObjectState) -> None:
        generations.append(generation() - start)
        hora.allreduce(np.array([1.0]), op=hora.Sum, name="work")
        raise HorovodInternalError("a peer failed (simulated on every rank)")

    try:
        train(state)
        outcome = "returned"
    except hora.HoraError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return {"generations": generations, "outcome": outcome}


def test_the_reset_limit_stops_with_an_error_naming_the_count_world_size_2(job: JobResults):
    for out in job.all("reset_limit"):
        assert out["generations"] == [0, 1, 2]
        assert out["outcome"].startswith("ResetLimitError: ")
        assert "reset 2 time(s)" in out["outcome"] and "HORA_ELASTIC_RESET_LIMIT=2" in out["outcome"]
        assert "a peer failed" in out["outcome"]


def _resources() -> dict[str, Any]:
    """What this process holds: threads, open file descriptors, mapped and named shared memory."""
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if "/dev/shm/" in line)
    named = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"hora-{os.getpid()}"))
    return {"threads": sorted(t.name for t in threading.enumerate()), "fds": len(os.listdir("/proc/self/fd")),
            "shm_mapped": mapped, "shm_named": named}


RESETS = 20


def _many_resets_job() -> dict[str, Any]:
    before_init = _resources()
    hora.init()
    calls: list[dict[str, Any]] = []
    state = hora.elastic.ObjectState(step=0)

    @hora.elastic.run
    def train(state: hora.elastic.ObjectState) -> int:
        total = hora.allreduce(np.ones(1 << 16), op=hora.Sum, name="work")  # use the world's transport
        calls.append({"generation": generation(), "pid": os.getpid(), "sum": float(total[0]),
                      **_resources()})
        # No rank leaves this world (its peers' engines then stop) before every rank has looked.
        hora.allreduce(np.ones(1), op=hora.Sum, name="looked")
        if len(calls) <= RESETS:
            raise HorovodInternalError("a peer failed (simulated on every rank)")
        return state.step

    train(state)
    hora.shutdown()
    return {"calls": calls, "before_init": before_init, "after_shutdown": _resources()}


def test_twenty_resets_in_a_row_leak_no_threads_sockets_or_shared_memory_world_size_2():
    results = hora.run(_many_resets_job, np=2, env=JOB_ENV)
    for out in results:
        calls = out["calls"]
        assert [c["generation"] for c in calls] == list(range(RESETS + 1))
        assert len({c["pid"] for c in calls}) == 1
        assert all(c["sum"] == 2.0 for c in calls)
        first, last = calls[0], calls[-1]
        assert last["threads"] == first["threads"]
        assert last["fds"] == first["fds"]
        assert last["shm_mapped"] == first["shm_mapped"]
        assert last["shm_named"] == [] and out["after_shutdown"]["shm_named"] == []
        assert out["after_shutdown"]["threads"] == out["before_init"]["threads"]
        assert out["after_shutdown"]["fds"] == out["before_init"]["fds"]
        assert out["after_shutdown"]["shm_mapped"] == out["before_init"]["shm_mapped"] == 0


def _elastic_mode_without_driver_job() -> dict[str, Any]:
    hora.init()
    state = hora.elastic.ObjectState(step=0)

    @hora.elastic.run
    def train(state: hora.elastic.ObjectState) -> None:
        hora.allreduce(np.array([1.0]), op=hora.Sum, name="work")
        raise HorovodInternalError("a peer failed (simulated on every rank)")

    try:
        train(state)
        outcome = "returned"
    except hora.HoraError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    initialised = hora.is_initialized()
    hora.shutdown()
    return {"outcome": outcome, "initialised": initialised}


def test_in_elastic_mode_a_reset_with_no_driver_to_open_the_round_fails_after_the_start_timeout_world_size_2():
    # HORA_ELASTIC=1 makes init() after shutdown() wait for the driver's round; no driver exists
    # yet, so the wait must end, in an error that says what was missing.
    results = hora.run(_elastic_mode_without_driver_job, np=2, start_timeout=5,
                       env={**JOB_ENV, "HORA_ELASTIC": "1", "HORA_START_TIMEOUT": "5"})
    for out in results:
        assert out["outcome"].startswith("HoraError: no rendezvous round after 0 was opened within 5 s")
        assert "elastic driver" in out["outcome"]
        assert out["initialised"] is False
