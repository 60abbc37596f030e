"""Many independent checks inside one multi-process job, for the binding tests (torch, TensorFlow, Keras).

Starting a job costs seconds (every worker imports its framework), so each test module runs one job per
world size in a module-scoped fixture. The job function runs named *sections* in a fixed order on
every rank; a section that raises is recorded (type, message, traceback) instead of ending the job,
so one broken feature fails only the tests that read that section. Tests then pick a section's value
on a rank with :meth:`JobResults.get`, which re-raises a recorded failure with its remote traceback.
"""

from __future__ import annotations

import inspect
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from job_env import SKIP_IMPORTS, skip_imports

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
        except Exception as exc:  # recorded and re-raised by the test that reads it
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
        if name not in self.per_rank[rank] and SETUP in self.per_rank[rank]:
            name = SETUP  # the section function itself raised: every section of it fails with that
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
    env = {**JOB_ENV, **(env or {})}
    return JobResults(hora.run(_job_main, args=(_Prelude.of(env), func), np=np, env=env))


class _Prelude:
    """What a worker does before it unpickles the job's functions: it travels first among their
    arguments, and unpickling it makes the packages a job's ``SKIP_IMPORTS`` variable names look
    absent (see :func:`job_env.skip_imports`) before any test module imports TensorFlow."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    @classmethod
    def of(cls, env: dict[str, str]) -> _Prelude:
        return cls(tuple(n for n in env.get(SKIP_IMPORTS, "").split(",") if n))

    def __reduce__(self) -> tuple[Any, ...]:
        return skip_imports, (self.names,)


def _job_main(prelude: None, func: Callable[[], list[tuple[str, Callable[[], Any]]]]) -> dict[str, Any]:
    hora.init()  # the same init as hora.torch.init, hora.tensorflow.init and hora.keras.init
    try:
        return run_sections(func())
    finally:
        hora.shutdown()


# ---- one job for several test modules --------------------------------------------------------------
#
# Every TensorFlow worker spends about 7 CPU-seconds importing TensorFlow (and Keras 3, which it
# loads eagerly), and a torch worker about 2, which is more than most modules' sections take to run
# (hora.torch's and hora.tensorflow's modules share jobs this way). Modules whose jobs need the
# same world size and environment therefore register their section functions with a SharedJob at
# import time (that is, at collection), and the first of them to ask for its results runs ONE job
# that calls every registered function, in collection order, each with its sections isolated as
# usual. Modules with no selected test (``-k``, ``-m "not slow"``) are left out of the job.

SETUP = "__setup__"  # where a section function that raised before returning its sections is recorded


@dataclass
class _SharedWorld:
    np: int
    env: dict[str, str]
    members: list[SharedJob]
    results: dict[str, JobResults] | None = None
    error: BaseException | None = None


_WORLDS: dict[tuple[int, tuple[tuple[str, str], ...]], _SharedWorld] = {}


def _function_id(func: Callable[..., Any]) -> str:
    return f"{func.__module__}.{func.__qualname__}"


class SharedJob:
    """A test module's share of the job every module with the same world size and environment runs.

    ``last=True`` puts the functions that change process-wide state for good (``disable_v2_behavior``)
    after every other module's sections.
    """

    def __init__(self, func: Callable[[], list[tuple[str, Callable[[], Any]]]], np: int,
                 env: dict[str, str] | None = None, *, last: bool = False) -> None:
        self.func, self.last, self.id = func, last, _function_id(func)
        self.file = os.path.realpath(inspect.getfile(func))
        env = {**JOB_ENV, **(env or {})}
        key = (np, tuple(sorted(env.items())))
        self._world = _WORLDS.setdefault(key, _SharedWorld(np, env, []))
        if all(member.id != self.id for member in self._world.members):
            self._world.members.append(self)

    def results(self, request: Any) -> JobResults:
        """This module's results; the first call runs the job (``request``: a pytest fixture request)."""
        world = self._world
        if world.results is None and world.error is None:
            selected = {os.path.realpath(str(item.path)) for item in request.session.items}
            members = [m for m in world.members if m.file in selected or m is self]
            members.sort(key=lambda m: m.last)
            try:
                per_rank = hora.run(_shared_main, args=(_Prelude.of(world.env), [m.func for m in members]),
                                    np=world.np, env=world.env)
                world.results = {m.id: JobResults([ranks[m.id] for ranks in per_rank]) for m in members}
            except BaseException as exc:  # every module sharing the job fails with its error
                world.error = exc
        if world.error is not None:
            raise world.error
        assert world.results is not None and self.id in world.results, f"{self.id} joined its job too late"
        return world.results[self.id]


def _shared_main(prelude: None,
                 funcs: list[Callable[[], list[tuple[str, Callable[[], Any]]]]]) -> dict[str, dict[str, Any]]:
    hora.init()
    try:
        out: dict[str, dict[str, Any]] = {}
        for func in funcs:
            try:
                sections = func()
            except Exception as exc:  # fails that module's tests, not the other modules'
                out[_function_id(func)] = {SETUP: SectionFailure(type(exc).__name__, str(exc), traceback.format_exc()),
                                           TIMINGS: {}}
                continue
            out[_function_id(func)] = run_sections(sections)
        return out
    finally:
        hora.shutdown()
