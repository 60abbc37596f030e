"""Many independent checks inside one multi-process job, for the binding tests (torch, TensorFlow, Keras).

Starting a job costs seconds (every worker imports its framework), so each test module runs one job per
world size in a module-scoped fixture. The job function runs named *sections* in a fixed order on
every rank; a section that raises is recorded (type, message, traceback) instead of ending the job,
so one broken feature fails only the tests that read that section. Tests then pick a section's value
on a rank with :meth:`JobResults.get`, which re-raises a recorded failure with its remote traceback.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import hora

# A request stuck because ranks diverged fails after this long instead of hanging the job; the
# per-test pytest timeout is the last line of defence.
JOB_ENV = {"HORA_STALL_SHUTDOWN_TIME_SECONDS": "45", "HORA_STALL_CHECK_TIME_SECONDS": "20"}


TIMINGS = "__seconds__"  # per-section wall time, for finding slow sections


@dataclass
class SectionFailure:
    """What a section raised on one rank (plain data, so it travels back from the worker)."""

    type_name: str
    message: str
    traceback: str


def run_sections(sections: list[tuple[str, Callable[[], Any]]]) -> dict[str, Any]:
    """Run ``sections`` in order on this rank; each result, or a SectionFailure, by section name."""
    out: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name, section in sections:
        assert name not in out, f"duplicate section name {name}"
        start = time.perf_counter()
        try:
            out[name] = section()
        except Exception as exc:  # noqa: BLE001 - recorded and re-raised by the test that reads it
            out[name] = SectionFailure(type(exc).__name__, str(exc), traceback.format_exc())
        seconds[name] = time.perf_counter() - start
    out[TIMINGS] = seconds
    return out


class JobResults:
    """Each rank's section results of one job."""

    def __init__(self, per_rank: list[dict[str, Any]]) -> None:
        self.per_rank = per_rank
        self.size = len(per_rank)

    def get(self, name: str, rank: int) -> Any:
        value = self.per_rank[rank][name]
        if isinstance(value, SectionFailure):
            raise AssertionError(f"section {name!r} raised {value.type_name} on rank {rank}: {value.message}\n"
                                 f"--- remote traceback ---\n{value.traceback}")
        return value

    def all(self, name: str) -> list[Any]:
        """The section's value on every rank, in rank order."""
        return [self.get(name, r) for r in range(self.size)]


def run_job(func: Callable[[], list[tuple[str, Callable[[], Any]]]], np: int,
            env: dict[str, str] | None = None) -> JobResults:
    """Run ``func`` (called once hora is initialised; it returns its sections) on ``np`` workers."""
    return JobResults(hora.run(_job_main, args=(func,), np=np, env={**JOB_ENV, **(env or {})}))


def _job_main(func: Callable[[], list[tuple[str, Callable[[], Any]]]]) -> dict[str, Any]:
    hora.init()  # the same init as hora.torch.init, hora.tensorflow.init and hora.keras.init
    try:
        return run_sections(func())
    finally:
        hora.shutdown()
