"""The conformance suite every registered transport must pass.

Parametrised over ``hora.transport.TRANSPORTS``: a transport added to the registry is tested here
with no other change. The matrix (built in :mod:`conformance_cases`) covers every collective of
:class:`~hora.transport.Communicator` x every dtype of ``SUPPORTED_DTYPES`` x every meaningful
reduce op x sizes (empty, one element, odd, not divisible by the world size, across the
small/large algorithm threshold and the pipeline chunk, many MiB) x world sizes 1-4, plus the
errors the contract promises and the behaviour after close(). Transports that care where ranks run
(hierarchical allreduce) run on emulated host layouts instead, uneven ones (2 + 1 ranks) included.

Starting a job costs far more than a collective, so each world (transport, world size, knobs) runs
as ONE job: every worker runs the whole case list and returns ``{case_id: (ok, detail, digest)}``.
The parametrised tests then look their case up: it passes when every rank checked its own result
against NumPy and every rank holds bit-identical bytes (the digest).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

import hora
from hora import config
from hora.transport import TRANSPORTS

# The workers import the case module by name (hora.run hands them this process's sys.path), so it
# must be importable as a top-level module whatever pytest's import mode.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from conformance_cases import build_cases, conformance_worker  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)
# Generous: a bug that desynchronises ranks shows up as this timeout, not as a hung test run.
JOB_TRANSPORT_TIMEOUT_S = 20
# The first test of each world pays for the job that runs every case.
TEST_TIMEOUT_S = 180


def thresholds(environ: dict[str, str]) -> dict[str, int]:
    """The transport knobs whose boundaries the suite straddles, as a job with ``environ`` sees them."""
    return {
        "small_bytes": int(config.get("ring_small_bytes", environ)),
        "chunk_bytes": max(1, int(config.get("ring_chunk_bytes", environ))),
    }


# ---- the tests -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """One job of the suite: a transport, a world size, and the knobs its workers run with."""

    transport: str
    size: int
    variant: str = ""
    env: tuple[tuple[str, str], ...] = ()
    hosts: tuple[int, ...] = ()  # ranks per emulated host, for transports that care where ranks run
    covering: int | None = None  # None: the full product of cases; k: build_cases' pairwise covering k

    @property
    def name(self) -> str:
        layout = f"-hosts{'+'.join(map(str, self.hosts))}" if self.hosts else ""
        return f"{self.transport}-np{self.size}{layout}" + (f"-{self.variant}" if self.variant else "")

    @property
    def knobs(self) -> dict[str, int]:
        """The thresholds the workers will see: this process's environment plus the world's."""
        return thresholds({**config.environ_copy(), **dict(self.env)})


# Every world size with the default knobs, plus one run that forces the pipelined algorithms with the
# smallest chunk on every message, so chunk and segment boundaries are hit at every size.
RING_ONLY_ENV = (("HORA_RING_SMALL_BYTES", "0"), ("HORA_RING_CHUNK_BYTES", "4096"))
# Same-host peers connect over Unix-domain sockets by default; this world keeps them on TCP.
NO_UNIX_ENV = (("HORA_UNIX_SOCKETS", "0"),)
# Transports whose algorithm depends on how ranks are spread over hosts run on emulated layouts
# instead (ranks given the same host label count as one host), uneven ones included.
HOST_LAYOUTS: dict[str, list[tuple[int, ...]]] = {
    "hierarchical": [(1,), (1, 1), (2, 1), (1, 2), (2, 2)],
}
UNEVEN_RING_ONLY = (2, 1)
# Transports whose workers mpirun must start (real Open MPI; --oversubscribe: CI has 2 cores).
LAUNCHED_BY_MPIRUN = {"mpi": "--oversubscribe"}


# One transport runs the full product of dtype x op x size x root x layout in every world; the
# others run a pairwise covering of it (every pair of those factors in every world, a different
# rotation per world) plus every edge case. A bug that needs one particular pair shows up in each
# world; one that needs a particular triple shows up on the full transport, whose algorithms the
# others share (shm's and hierarchical's inner steps are the ring's).
FULL_PRODUCT_TRANSPORT = "tcp"


def _worlds(transport: str) -> list[World]:
    if transport in LAUNCHED_BY_MPIRUN:  # the ring knobs and socket kinds are not the MPI library's
        worlds = [World(transport, n) for n in WORLD_SIZES]
    elif (layouts := HOST_LAYOUTS.get(transport)) is None:
        worlds = [World(transport, n) for n in WORLD_SIZES] + [
            World(transport, 3, "ring_only", RING_ONLY_ENV), World(transport, 3, "no_unix", NO_UNIX_ENV)]
    else:
        worlds = [World(transport, sum(hosts), hosts=hosts) for hosts in layouts] + [
            World(transport, sum(UNEVEN_RING_ONLY), "ring_only", RING_ONLY_ENV, UNEVEN_RING_ONLY)]
    if transport == FULL_PRODUCT_TRANSPORT:
        return worlds
    return [replace(world, covering=k) for k, world in enumerate(worlds)]


WORLDS = {world.name: world for transport in sorted(TRANSPORTS) for world in _worlds(transport)}
_JOBS: dict[str, Any] = {}


def _job_results(world: World) -> list[dict[str, Any]] | BaseException:
    """Run (once per session) the job that executes every case of ``world``."""
    if world.name not in _JOBS:
        env = {"HORA_TRANSPORT_TIMEOUT": str(JOB_TRANSPORT_TIMEOUT_S), **dict(world.env)}
        try:
            mpi_args = LAUNCHED_BY_MPIRUN.get(world.transport)
            _JOBS[world.name] = hora.run(
                conformance_worker, args=(world.transport, world.knobs, world.hosts, None, world.covering),
                np=world.size, env=env,
                use_mpi=mpi_args is not None or None, mpi_args=mpi_args)
        except Exception as exc:  # every case of this world reports it
            _JOBS[world.name] = exc
    return _JOBS[world.name]


# Known transport bugs, reported to the transport's owner: (world name, case id) -> reason. Strict, so
# the fix shows up as XPASS(strict) and the entry is removed with it.
KNOWN_BUGS: dict[tuple[str, str], str] = {}


def _params() -> list[Any]:
    params = []
    for name, world in WORLDS.items():
        for case in build_cases(world.size, **world.knobs, covering=world.covering):
            reason = KNOWN_BUGS.get((name, case.id))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(name, case.id, id=f"{name}-{case.id}", marks=marks))
    return params


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Every rank's result table for one world; its job runs once."""
    results = _job_results(WORLDS[request.param])
    if isinstance(results, BaseException):
        pytest.fail(f"the conformance job for {request.param} failed: {type(results).__name__}: {results}")
    unavailable = [r.get("__unavailable__") for r in results if "__unavailable__" in r]
    if unavailable:
        pytest.skip(f"transport unavailable here: {unavailable[0]}")
    return results


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("world", "case_id"), _params(), indirect=["world"])
def test_conformance(world: list[dict[str, Any]], case_id: str) -> None:
    failures = []
    for rank, table in enumerate(world):
        if case_id not in table:
            failures.append(f"rank {rank} did not run this case")
            continue
        ok, detail, _ = table[case_id]
        if not ok:
            failures.append(detail)
    assert not failures, "\n".join(failures)
    digests = {rank: table[case_id][2] for rank, table in enumerate(world) if table[case_id][2] is not None}
    assert len(set(digests.values())) <= 1, f"ranks hold different bytes: {digests}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(WORLDS))
def test_every_rank_ran_the_same_case_list(name: str) -> None:
    """The case ids and their order do not depend on the rank (else collectives would mismatch)."""
    world = WORLDS[name]
    results = _job_results(world)
    if isinstance(results, BaseException):
        pytest.fail(f"the conformance job for {name} failed: {results}")
    expected = [case.id for case in build_cases(world.size, **world.knobs, covering=world.covering)]
    for rank, table in enumerate(results):
        if "__unavailable__" in table:
            pytest.skip(table["__unavailable__"])
        assert list(table) == expected, f"rank {rank} of {world.size} ran a different case list"
