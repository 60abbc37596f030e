"""Who runs the engine's cycles: a thread waiting on a handle drives them itself, the engine thread
runs them for requests nobody waits on, and several waiting threads share the work (2 ranks)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import hora

pytestmark = pytest.mark.timeout(120)


def _driving_job() -> dict[str, Any]:
    from hora import basics

    hora.init()
    r, n = hora.rank(), hora.size()
    out: dict[str, Any] = {}

    # Nobody waits: the engine thread alone must complete these (poll only), both right after init
    # and after a long idle spell (the engine thread then sleeps longer than a cycle time).
    for label, idle in (("busy", 0.0), ("after_idle", 0.3)):
        time.sleep(idle)
        handles = [hora.allreduce_async(np.full(5, i + r, np.float32), op=hora.Sum, name=f"{label}.{i}")
                   for i in range(8)]
        deadline = time.monotonic() + 30
        while not all(hora.poll(h) for h in handles) and time.monotonic() < deadline:
            time.sleep(0.001)
        out[label] = [hora.synchronize(h).tolist() if hora.poll(h) else None for h in handles]

    # Four threads, each looping over its own names and synchronizing its own handles, while
    # the main thread does the same: every waiter may drive cycles, one at a time.
    errors: list[str] = []
    results: dict[int, list[float]] = {}

    def worker(t: int) -> None:
        try:
            total = []
            for step in range(40):
                h = hora.allreduce_async(np.full(3, float(t * 100 + step + r)), op=hora.Sum, name=f"thr{t}.v")
                total.append(float(hora.synchronize(h)[0]))
            results[t] = total
        except Exception as exc:  # reported to the test
            errors.append(f"thread {t}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    worker(4)
    for thread in threads:
        thread.join(60)
    out["threads"] = {str(t): v for t, v in results.items()}
    out["thread_errors"] = errors
    out["alive"] = [t.is_alive() for t in threads]

    # A wait with a timeout does not drive: it still completes through the engine thread.
    h = hora.allreduce_async(np.full(2, 1.0 + r), op=hora.Sum, name="timed")
    out["timed"] = h.wait(timeout=30).tolist()

    # A failure found by a driving thread fails the handle in that thread with the usual error.
    try:
        hora.allreduce(np.ones(2 + r, np.float32), name="shape.mismatch")
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    out["after"] = hora.allreduce(np.full(2, float(r)), op=hora.Sum, name="after").tolist()
    out["engine_thread_alive"] = basics.engine().thread.is_alive()
    out["size"] = n
    hora.shutdown()
    return out


def test_waiting_threads_drive_cycles_and_the_engine_thread_serves_the_rest():
    outs = hora.run(_driving_job, np=2, start_timeout=60)
    for r, out in enumerate(outs):
        for label in ("busy", "after_idle"):
            assert out[label] == [[float(2 * i + 1)] * 5 for i in range(8)], (r, label)
        assert out["thread_errors"] == [] and out["alive"] == [False] * 4
        for t in range(5):
            assert out["threads"][str(t)] == [float(2 * (t * 100 + s) + 1) for s in range(40)], (r, t)
        assert out["timed"] == [3.0, 3.0]
        assert out["mismatch"] is not None and "shape" in out["mismatch"].lower()
        assert out["after"] == [1.0, 1.0]
        assert out["engine_thread_alive"]
