"""Every wait on a collective ends: in its result, in an error, or (while it goes on) in a report
that says what it waits for. Nothing the engine can no longer complete is left waiting (real ranks).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest

import hora
from hora.binding import batched
from hora.horovod_args import GradientReduction

pytestmark = pytest.mark.timeout(120)

#: How long a worker gives a wait that should end at once before calling it hung.
HUNG_AFTER_S = 20.0


def _outcome(handle) -> dict[str, Any]:
    """Wait on ``handle`` in a daemon thread (driving cycles, as synchronize does); what happened."""
    box: dict[str, Any] = {"state": "hung"}

    def wait() -> None:
        try:
            box["value"] = hora.synchronize(handle)
            box["state"] = "result"
        except Exception as exc:  # the test reads type and message
            box.update(state="error", type=type(exc).__name__, message=str(exc))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(HUNG_AFTER_S)
    return dict(box)


def _removed_set_job() -> dict[str, Any]:
    hora.init()
    r = hora.rank()
    out: dict[str, Any] = {}
    ps = hora.add_process_set([0, 1])  # rank 2 is not in it
    # Rank 0 starts a collective on the set that rank 1 never joins, then both remove the set.
    handle = hora.allreduce_async(np.ones(2), name="orphan", process_set=ps) if r == 0 else None
    hora.remove_process_set(ps)
    if handle is not None:
        out["orphan"] = _outcome(handle)
    out["after"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum, name="after.removal")
    hora.shutdown()
    return out


def _reported_wait_job() -> dict[str, Any]:
    hora.init()
    r = hora.rank()
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("hora.engine.engine").addHandler(Capture())
    out: dict[str, Any] = {}
    if r == 1:
        # Rank 1 waits on a name rank 0 submits only a few seconds later.
        out["late"] = hora.allreduce(np.ones(2), op=hora.Sum, name="late")
    else:
        threading.Event().wait(4.0)
        out["late"] = hora.allreduce(np.ones(2), op=hora.Sum, name="late")
    out["reports"] = [m for m in records if "'late'" in m]
    hora.shutdown()
    return out


def _uneven_unnamed_job() -> dict[str, Any]:
    hora.init()
    r = hora.rank()
    alone = hora.add_process_set([0])
    out: dict[str, Any] = {}
    if r == 0:
        # Unnamed collectives on a set rank 1 is not in: rank 1 never makes these calls.
        out["alone"] = [hora.allreduce(np.ones(2), process_set=alone).tolist(),
                        hora.allgather(np.ones(1), process_set=alone).tolist()]
        hora.barrier(process_set=alone)
        # ... and the gradient-list helpers the TensorFlow and Keras bindings use for unnamed
        # gradients and variables.
        reduction = GradientReduction.create(None, 1.0, alone)
        out["alone_batched"] = [batched.reduce_arrays([np.ones(2)], [None], reduction)[0].tolist(),
                                batched.broadcast_arrays([np.ones(1)], 0, alone)[0].tolist()]
    # The next unnamed collectives of the whole job must still pair up across ranks. (When they did
    # not, each rank drove cycles in Handle.wait with its engine thread idle, and nothing was said
    # until the stall inspector's time.)
    hora.barrier()
    out["allreduce"] = hora.allreduce(np.full(2, r + 1.0), op=hora.Sum).tolist()
    out["allgather"] = hora.allgather(np.full(1, r)).tolist()
    out["objects"] = hora.allgather_object(r)
    hora.shutdown()
    return out


def test_unnamed_collectives_on_a_smaller_set_leave_the_whole_jobs_names_in_step_2ranks():
    results = hora.run(_uneven_unnamed_job, np=2, env={"HORA_STALL_CHECK_TIME_SECONDS": "5",
                                                       "HORA_STALL_SHUTDOWN_TIME_SECONDS": "20"})
    assert results[0]["alone"] == [[1.0, 1.0], [1.0]]
    assert results[0]["alone_batched"] == [[1.0, 1.0], [1.0]]
    for r in range(2):
        assert results[r]["allreduce"] == [3.0, 3.0]
        assert results[r]["allgather"] == [0, 1]
        assert results[r]["objects"] == [0, 1]


def test_a_collective_pending_on_a_removed_process_set_fails_instead_of_hanging_3ranks():
    results = hora.run(_removed_set_job, np=3, env={"HORA_STALL_CHECK_TIME_SECONDS": "60"})
    orphan = results[0]["orphan"]
    assert orphan["state"] == "error", orphan
    assert "process set" in orphan["message"] and "removed" in orphan["message"], orphan
    for r in range(3):
        assert results[r]["after"].tolist() == [6.0, 6.0]  # the job goes on


def test_a_long_wait_reports_on_the_waiting_rank_what_it_waits_for_2ranks():
    results = hora.run(_reported_wait_job, np=2, env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    for r in range(2):
        assert results[r]["late"].tolist() == [2.0, 2.0]
    reports = results[1]["reports"]
    assert reports, "rank 1 waited 4 s with a 1 s stall time and said nothing"
    assert any("rank 1" in m and "waited" in m for m in reports), reports


def _interrupted_job() -> dict[str, Any]:
    import time

    from hora import basics

    hora.init()
    r = hora.rank()
    out: dict[str, Any] = {}
    engine = basics.engine()
    if r == 0:
        # A KeyboardInterrupt (or a test runner's time-out) lands in the thread that runs the cycle
        # executing "victim": this rank cannot tell its peer where it stopped. Which thread that is
        # depends on timing: the caller, driving the cycles while it waits, or the engine thread,
        # when it ran the cycle before the caller began to wait (seen on a loaded machine).
        executor = engine._sets[0].executor
        run = executor.run

        def interrupted(items):
            if any(item.response.name == "victim" for item in items):
                out["interrupted_in"] = threading.current_thread().name
                raise KeyboardInterrupt
            return run(items)

        executor.run = interrupted
    start = time.monotonic()
    try:
        hora.allreduce(np.ones(2), name="victim")
        out["victim"] = "result"
    except KeyboardInterrupt:
        out["victim"] = "KeyboardInterrupt"
    except Exception as exc:
        out["victim"] = type(exc).__name__
        out["victim_message"] = str(exc)
    out["victim_s"] = time.monotonic() - start
    later = []
    for call in (hora.barrier, lambda: hora.allreduce(np.ones(2), name="later")):
        start = time.monotonic()
        try:
            call()
            later.append(("result", time.monotonic() - start))
        except Exception as exc:
            later.append((type(exc).__name__, time.monotonic() - start))
    out["later"] = later
    return out


def test_after_a_rank_is_interrupted_mid_collective_every_later_collective_fails_fast_2ranks():
    results = hora.run(_interrupted_job, np=2, env={"HORA_TRANSPORT_TIMEOUT": "3"})
    if results[0]["interrupted_in"] == "MainThread":  # the caller gets its own interrupt
        assert results[0]["victim"] == "KeyboardInterrupt", results[0]
    else:  # the engine thread died of it: every handle it held fails, saying why
        assert results[0]["interrupted_in"] == "hora-engine", results[0]
        assert results[0]["victim"] == "HorovodInternalError", results[0]
        assert "interrupted during a collective" in results[0]["victim_message"], results[0]
    assert results[1]["victim"] in ("HorovodInternalError", "result"), results[1]
    assert results[1]["victim_s"] < 60  # the peer's wait ends (transport time-out 3 s), no hang
    for r in range(2):
        for outcome, seconds in results[r]["later"]:
            assert outcome == "HorovodInternalError" and seconds < 5, (r, results[r]["later"])
