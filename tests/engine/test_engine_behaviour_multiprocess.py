"""The engine's behaviour in real multi-rank jobs: async allreduces submitted in different orders on
different ranks; a thousand steps without memory or per-step time growth; mismatched shapes and
dtypes failing on every rank while the job goes on; a SIGKILLed rank failing every other rank's
collectives quickly; the timeline of a 2-rank run; reusing an in-flight name; the stall inspector;
steady-state steps served by the response cache without negotiation rounds.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import pytest
from engine_helpers import job_env

import hora
from hora.errors import WorkerFailedError

pytestmark = pytest.mark.timeout(120)

ORDERED = 50
STEPS, PER_STEP = 1000, 10


def _ordered_value(i: int, rank: int) -> np.ndarray:
    return np.full(3 + i % 4, 10.0 * i + rank, dtype=np.float32 if i % 3 else np.float64)


def _error_record(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc), "runtime": isinstance(exc, RuntimeError),
            "internal": isinstance(exc, hora.HorovodInternalError)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- the shared 2-rank job ------------------------------------------------------------------------


def _bar_job() -> dict[str, Any]:
    import gc
    import sys

    from hora import basics

    hora.init()
    r, n = hora.rank(), hora.size()
    out: dict[str, Any] = {}

    # 50 async allreduces, reversed on odd ranks; three rounds (negotiated, then cached).
    rounds = []
    for _ in range(3):
        order = list(range(ORDERED))[:: -1 if r % 2 else 1]
        handles = {i: hora.allreduce_async(_ordered_value(i, r), op=hora.Sum if i % 2 else hora.Average,
                                           name=f"ordered.{i}") for i in order}
        rounds.append({i: hora.synchronize(h) for i, h in handles.items()})
    out["ordered"] = rounds

    # mismatched shape, then dtype: RuntimeError on every rank; the next allreduce works.
    mismatch: dict[str, Any] = {}
    for label, tensor in (("shape", np.ones(3 + r, np.float32)),
                          ("dtype", np.ones(3, np.float32 if r == 0 else np.float64))):
        try:
            hora.allreduce(tensor, op=hora.Sum, name=f"mismatch.{label}")
            mismatch[label] = None
        except Exception as exc:  # reported to the test
            mismatch[label] = _error_record(exc)
        mismatch[f"after_{label}"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum, name=f"after.{label}")
    # The failed name is free again, and agreeing requests under it succeed.
    mismatch["reused"] = hora.allreduce(np.ones(3, np.float32), op=hora.Sum, name="mismatch.shape")
    out["mismatch"] = mismatch

    # reusing the name of a request still in flight raises ValueError at submission. Rank 0
    # submits before the others pass the barrier, so its request cannot have completed.
    dup: dict[str, Any] = {}
    if r == 0:
        first = hora.allreduce_async(np.ones(2), op=hora.Sum, name="dup")
        try:
            hora.allreduce_async(np.ones(2), op=hora.Sum, name="dup")
            dup["error"] = None
        except ValueError as exc:
            dup["error"] = str(exc)
        try:
            hora.broadcast_async(np.ones(2), 0, name="dup")  # any collective kind
            dup["error_other_kind"] = None
        except ValueError as exc:
            dup["error_other_kind"] = str(exc)
        hora.barrier()
        dup["first"] = hora.synchronize(first)
    else:
        hora.barrier()
        dup["first"] = hora.allreduce(np.ones(2), op=hora.Sum, name="dup")
    dup["again"] = hora.allreduce(np.ones(2), op=hora.Sum, name="dup")  # completed: reusable
    out["dup"] = dup

    # the timeline was started by HORA_TIMELINE; stop it before the long loop.
    hora.stop_timeline()

    # STEPS identical steps of PER_STEP tensors, in opposite orders on odd ranks.
    engine = basics.engine()
    names = [f"step.{i}" for i in range(PER_STEP)][:: -1 if r % 2 else 1]
    inputs = {name: np.full(64, float(i + r), np.float32) for i, name in enumerate(sorted(names))}
    expected = {name: np.full(64, n * i + n * (n - 1) / 2, np.float32) for i, name in enumerate(sorted(names))}
    durations, memory, wrong = np.zeros(STEPS), {}, 0  # preallocated: the probes below count blocks
    rounds_after_first = None
    for step in range(1, STEPS + 1):
        start = time.perf_counter()
        handles = [hora.allreduce_async(inputs[name], op=hora.Sum, name=name) for name in names]
        results = [hora.synchronize(h) for h in handles]
        durations[step - 1] = time.perf_counter() - start
        wrong += sum(not np.array_equal(res, expected[name]) for res, name in zip(results, names))
        if step == 1:
            rounds_after_first = engine.negotiation_rounds
        if step in (200, STEPS):
            # Cheap, exact probes (tracemalloc would slow every step down several times): pymalloc
            # blocks catch leaked Python objects, including array headers; RSS catches leaked buffers.
            del handles, results
            gc.collect()
            memory[step] = {"blocks": sys.getallocatedblocks(), "objects": len(gc.get_objects()),
                            "rss": _rss_bytes()}
    out["steps"] = {
        "wrong": wrong,
        "first100_ms": 1e3 * float(np.mean(durations[:100])),
        "last100_ms": 1e3 * float(np.mean(durations[-100:])),
        "memory": memory,
        "rounds_after_first": rounds_after_first,
        "rounds_at_end": engine.negotiation_rounds,
        "cache_entries": len(engine._sets[0].cache),
        "in_flight": len(engine._sets[0].in_flight),
    }
    hora.shutdown()
    return out


@pytest.fixture(scope="module")
def bar(tmp_path_factory) -> tuple[list[dict[str, Any]], str]:
    timeline = str(tmp_path_factory.mktemp("bar") / "timeline.json")
    env = job_env(timeline=timeline, stall_check_time_seconds=5, stall_shutdown_time_seconds=20)
    return hora.run(_bar_job, np=2, env=env), timeline


def test_async_allreduces_in_different_orders_world_size_2(bar):
    results, _ = bar
    for res in results:
        assert len(res["ordered"]) == 3
        for round_ in res["ordered"]:
            assert sorted(round_) == list(range(ORDERED))
            for i, value in round_.items():
                total = _ordered_value(i, 0).astype(np.float64) + _ordered_value(i, 1)
                want = total if i % 2 else total / 2
                assert value.dtype == _ordered_value(i, 0).dtype and value.shape == want.shape
                np.testing.assert_allclose(value, want, rtol=1e-6)


def test_thousand_steps_without_memory_or_time_growth_world_size_2(bar):
    results, _ = bar
    for res in results:
        steps = res["steps"]
        assert steps["wrong"] == 0
        assert steps["in_flight"] == 0
        early, late = steps["memory"][200], steps["memory"][STEPS]
        # One leaked object per step would be 800 blocks by step 1,000; per tensor, 8,000.
        assert late["blocks"] - early["blocks"] < 400, (early, late)
        assert late["objects"] - early["objects"] < 500, (early, late)
        assert late["rss"] - early["rss"] < 8 * 2**20, (early, late)
        # A sanity check against per-step growth (e.g. scanning ever-growing state), not a benchmark:
        # a ten-fold factor, plus absolute slack for a busy 2-core machine.
        first, last = steps["first100_ms"], steps["last100_ms"]
        assert last < 10 * first + 5.0, steps


def test_mismatched_shape_and_dtype_fail_on_every_rank_and_the_job_goes_on_world_size_2(bar):
    results, _ = bar
    for res in results:
        mismatch = res["mismatch"]
        for label, values in (("shape", ("[3]", "[4]")), ("dtype", ("float32", "float64"))):
            error = mismatch[label]
            assert error is not None, f"{label} mismatch did not raise"
            assert error["runtime"] and not error["internal"], error
            message = error["message"]
            assert f"mismatch.{label}" in message and "rank 0" in message and "rank 1" in message, message
            assert all(value in message for value in values), message
            np.testing.assert_array_equal(mismatch[f"after_{label}"], [3.0, 3.0])
        np.testing.assert_array_equal(mismatch["reused"], [2, 2, 2])


def test_timeline_of_a_2_rank_run_world_size_2(bar):
    _, path = bar
    with open(path) as handle:
        events = json.load(handle)
    pids = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
    assert len(set(pids.values())) == len(pids)  # one trace process per tensor name
    for i in range(ORDERED):
        name = f"ordered.{i}"
        assert name in pids, f"no process_name for {name}"
        mine = [e for e in events if e.get("pid") == pids[name]]
        spans = [(e["ph"], e["name"]) for e in mine]
        for ph in "BE":
            assert (ph, "NEGOTIATE_ALLREDUCE") in spans and (ph, "ALLREDUCE") in spans, spans
        # One NEGOTIATE span by name (the first round), an instant per rank; the later rounds are
        # served by the response cache and traced as cached negotiations.
        negotiations = [e for e in mine if e["ph"] == "B" and e["name"] == "NEGOTIATE_ALLREDUCE"]
        assert len(negotiations) == 3
        assert [bool(e.get("args", {}).get("cached")) for e in negotiations] == [False, True, True]
        assert all(e["args"]["members"] == 2 for e in negotiations[1:])
        assert {e["name"] for e in mine if e["ph"] == "i"} == {"0", "1"}
        assert spans.count(("B", "ALLREDUCE")) == spans.count(("E", "ALLREDUCE")) == 3
        closing = [e for e in mine if e["ph"] == "E" and e["name"] == "ALLREDUCE"]
        want = _ordered_value(i, 0)
        assert closing[0]["args"] == {"dtype": want.dtype.name, "shape": list(want.shape)}
        activities = {n for ph, n in spans} - {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"}
        assert "QUEUE" in activities and any(a.endswith("_ALLREDUCE") for a in activities), activities
        begin = [e["ts"] for e in mine if e["ph"] == "B" and e["name"] == "NEGOTIATE_ALLREDUCE"][0]
        end = [e["ts"] for e in mine if e["ph"] == "E" and e["name"] == "ALLREDUCE"][-1]
        assert begin <= end
    errors = [e for e in events if e.get("pid") == pids["mismatch.shape"] and "error" in e.get("args", {})]
    assert errors and "shapes" in errors[0]["args"]["error"]
    assert not any(name.startswith("step.") for name in pids)  # stopped before the long loop


def test_reusing_an_in_flight_name_raises_value_error_world_size_2(bar):
    results, _ = bar
    dup = results[0]["dup"]
    for key in ("error", "error_other_kind"):
        assert dup[key] is not None and "'dup'" in dup[key] and "in flight" in dup[key]
    for res in results:
        np.testing.assert_array_equal(res["dup"]["first"], [2.0, 2.0])
        np.testing.assert_array_equal(res["dup"]["again"], [2.0, 2.0])


def test_steady_state_steps_hit_the_response_cache_world_size_2(bar):
    results, _ = bar
    for res in results:
        steps = res["steps"]
        assert steps["rounds_after_first"] > 0
        assert steps["rounds_at_end"] == steps["rounds_after_first"], (
            f"{steps['rounds_at_end'] - steps['rounds_after_first']} negotiation rounds in "
            f"{STEPS - 1} cached steps")
        assert steps["cache_entries"] >= PER_STEP


# ---- a rank killed with SIGKILL ---------------------------------------------------------------

VICTIM = 2
DETECT_LIMIT_S = 10.0


def _kill_job(tmpdir: str) -> None:
    import signal

    hora.init()
    r = hora.rank()
    path = os.path.join(tmpdir, f"rank{r}.json")
    if r != VICTIM:
        # The launcher stops the job (SIGTERM) once the victim dies; survive long enough to report.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record: dict[str, Any] = {"rank": r}
    step = 0
    try:
        while step < 100_000:
            step += 1
            if r == VICTIM and step == 20:
                with open(path, "w") as handle:
                    json.dump({"rank": r, "died_at": time.time()}, handle)
                os.kill(os.getpid(), signal.SIGKILL)
            handles = [hora.allreduce_async(np.ones(256, np.float32), op=hora.Sum, name=f"k.{i}")
                       for i in range(4)]
            for h in handles:
                hora.synchronize(h)
        record["error"] = None
    except Exception as exc:  # reported to the test
        record.update(_error_record(exc), error=str(exc), raised_at=time.time(), step=step)
        try:  # the engine stays failed: a new collective fails at once
            hora.allreduce(np.ones(1), name="after_failure")
            record["after"] = None
        except Exception as again:
            record["after"] = _error_record(again)
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(record, handle)
    os.replace(tmp, path)


def test_sigkill_of_one_rank_fails_the_others_within_seconds_world_size_3(tmp_path):
    with pytest.raises(WorkerFailedError) as failure:
        hora.run(_kill_job, args=(str(tmp_path),), np=3, kill_grace=30,
                 env=job_env(stall_check_time_seconds=5, stall_shutdown_time_seconds=20))
    assert failure.value.rank == VICTIM
    died_at = json.loads((tmp_path / f"rank{VICTIM}.json").read_text())["died_at"]
    for rank in range(3):
        if rank == VICTIM:
            continue
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["error"] is not None and record["internal"], record
        assert record["type"] in ("HorovodInternalError", "TransportError", "PeerFailureError"), record
        assert record["raised_at"] - died_at < DETECT_LIMIT_S, record
        assert record["after"] is not None and record["after"]["internal"], record


# ---- the stall inspector ----------------------------------------------------------------------


def _stall_job() -> dict[str, Any]:
    import logging

    class Capture(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    capture = Capture()
    logging.getLogger("hora.engine.engine").addHandler(capture)
    hora.init()
    r = hora.rank()
    out: dict[str, Any] = {"rank": r}
    start = time.monotonic()
    if r == 0:
        pending = hora.allreduce_async(np.ones(2), name="x")
        hora.barrier()  # orders 'x' before anything rank 1 submits
    else:
        hora.barrier()
        pending = hora.allreduce_async(np.ones(2), name="y")  # rank 1 never submits 'x'
    try:
        hora.synchronize(pending)
        out["error"] = None
    except Exception as exc:  # reported to the test
        out.update(_error_record(exc), error=str(exc), elapsed=time.monotonic() - start)
    out["warnings"] = list(capture.messages)
    hora.shutdown()
    return out


def test_stall_inspector_warns_then_fails_every_rank_world_size_2():
    env = job_env(stall_check_time_seconds=1, stall_shutdown_time_seconds=3)
    results = hora.run(_stall_job, np=2, env=env)
    warnings = [w for w in results[0]["warnings"] if "'x'" in w and "missing ranks [1]" in w]
    assert warnings, results[0]["warnings"]
    for res in results:
        assert res["error"] is not None and res["internal"], res
        message = res["message"]
        assert "'x'" in message and "ranks [1] never submitted" in message, message
        assert 2.5 <= res["elapsed"] < 30, res  # shuts down at 3 s; bound ~10x


def _stall_with_captured_stderr() -> str:
    """Rank 0 stalls on 'x' while its ``sys.stderr`` is a StringIO, as under pytest, Jupyter or a logger
    that captures it; the report must still reach the process's own stderr."""
    import io
    import sys

    hora.init()
    captured = io.StringIO()
    sys.stderr = captured
    try:
        if hora.rank() == 0:
            pending = hora.allreduce_async(np.ones(2), name="x")
            hora.barrier()
        else:
            hora.barrier()
            pending = hora.allreduce_async(np.ones(2), name="y")
        try:
            hora.synchronize(pending)
        except Exception:  # the stall shutdown; what matters is where the report went
            pass
    finally:
        sys.stderr = sys.__stderr__
    hora.shutdown()
    return captured.getvalue()


@pytest.mark.parametrize("size", [2, 3])
def test_stall_report_reaches_the_process_stderr_even_when_sys_stderr_is_captured(capsys, size):
    env = job_env(stall_check_time_seconds=1, stall_shutdown_time_seconds=3)
    hora.run(_stall_with_captured_stderr, np=size, env=env)
    relayed = capsys.readouterr().err
    # The launcher relays each worker's own stderr (file descriptor 2) with its rank prefix.
    lines = [line for line in relayed.splitlines() if line.startswith("[0]<stderr>:") and "'x'" in line]
    missing = str(list(range(1, size)))
    assert any(f"missing ranks {missing}" in line for line in lines), relayed[-3000:]
