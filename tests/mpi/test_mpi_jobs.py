"""Jobs started by the real Open MPI ``mpirun`` (no ``hora run``), ``hora run --mpi`` and
``hora.run(use_mpi=True)``: identity, init(comm=...), process sets from communicators, the MPI
flags, the file rendezvous, training to the same accuracy as under ``hora run``, and a rank that dies.

Only the training test imports torch in its ranks: elsewhere the collectives are hora's own on NumPy
arrays, since what is checked is how the world forms and fails, and torch's import costs every rank
seconds of CPU.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from mpi_jobs import HERE, hora_cli, mpirun, records

import hora

pytestmark = pytest.mark.skipif(not __import__("shutil").which("mpirun"),
                                reason="Open MPI's mpirun is not installed (apt-get install openmpi-bin)")


@pytest.fixture(scope="module")
def world_checks() -> dict[tuple[str, int], object]:
    """One 4-rank mpirun job running every phase of mpi_world_script.py; {(check, rank): value}."""
    out = mpirun(4, [str(HERE / "mpi_world_script.py")], timeout=240).stdout
    found = {}
    for text in records(out, "CHECK"):
        record = json.loads(text)
        found[(record["name"], record["rank"])] = record["value"]
    assert all(("done", r) in found for r in range(4)), out
    return found


@pytest.mark.timeout(300)
def test_mpirun_gives_each_rank_its_place_and_mpi_is_in_use(world_checks) -> None:
    for r in range(4):
        assert world_checks[("identity", r)] == [r, 4, r, 4]
        assert world_checks[("flags", r)] == [True, True, True]  # mpi_built, mpi_enabled, threads (MULTIPLE)
        assert world_checks[("sum", r)] == 10.0


@pytest.mark.timeout(300)
def test_process_sets_from_mpi_communicators(world_checks) -> None:
    for r in range(4):
        assert world_checks[("set_from_comm", r)] == ([1, 3] if r % 2 else [0, 2])
        assert world_checks[("set_sum", r)] == (4.0 if r % 2 else 2.0)


@pytest.mark.timeout(300)
def test_init_with_a_sub_communicator_of_2_out_of_4_gives_size_2(world_checks) -> None:
    # Split: each half of the world is its own job of 2
    for r in range(4):
        assert world_checks[("half", r)] == [r % 2, 2, 1.0 if r < 2 else 5.0]
    # Create_group on ranks 1 and 3: only they call init(comm=...)
    assert world_checks[("pair", 1)] == [0, 2, 4.0] and world_checks[("pair", 3)] == [1, 2, 4.0]
    assert ("pair", 0) not in world_checks and ("pair", 2) not in world_checks
    # a list of ranks under mpirun
    assert world_checks[("list", 0)] == [0, 2, 2.0] and world_checks[("list", 2)] == [1, 2, 2.0]


@pytest.mark.timeout(200)
def test_without_mpi4py_the_ranks_meet_through_rank_0s_rendezvous_file(tmp_path) -> None:
    script = ("import sys, hora, numpy as np; hora.init(); "
              "s = float(hora.allreduce(np.array([1.0 + hora.rank()]), op=hora.Sum)[0]); "
              "sys.stdout.write(f'RESULT {hora.rank()} {hora.size()} {hora.mpi_enabled()} {s}\\n'); sys.stdout.flush()")
    out = mpirun(3, ["-c", script], {"HORA_MPI_BOOTSTRAP": "file", "HORA_MPI_RENDEZVOUS_DIR": str(tmp_path)}).stdout
    lines = sorted(records(out, "RESULT"))
    assert lines == [f"{r} 3 False 6.0" for r in range(3)], out  # formed without MPI: mpi_enabled() is False
    assert list(tmp_path.iterdir()) == [], "rank 0 leaves no rendezvous file behind"


def _final_accuracy(out: str) -> float:
    found = re.findall(r"Final test accuracy: ([0-9.]+)%", out)
    assert len(found) == 1, out
    return float(found[0])


@pytest.mark.timeout(600)
def test_mpirun_trains_pytorch_mnist_to_the_same_accuracy_as_hora_run() -> None:
    """Two ranks each way: every rank costs seconds to start (torch, scikit-learn), and two already
    make the gradients travel between processes."""
    args = ["examples/pytorch_mnist.py", "--epochs", "2"]
    under_mpirun = _final_accuracy(mpirun(2, args, timeout=290).stdout)
    under_hora_run = _final_accuracy(hora_cli(["run", "-np", "2", "python", *args], timeout=290).stdout)
    assert under_mpirun > 70.0  # 10 classes, 2 epochs of 1437 images
    assert abs(under_mpirun - under_hora_run) <= 0.5, (under_mpirun, under_hora_run)


@pytest.mark.timeout(200)
def test_hora_run_mpi_starts_the_ranks_through_mpirun() -> None:
    script = ("import sys, hora, numpy as np, os; hora.init(); "
              "s = float(hora.allreduce(np.array([1.0 + hora.rank()]), op=hora.Sum)[0]); "
              "w = os.environ['OMPI_COMM_WORLD_RANK']; "
              "sys.stdout.write(f'RESULT {hora.rank()} {hora.size()} {hora.mpi_enabled()} {w} {s}\\n'); "
              "sys.stdout.flush()")
    out = hora_cli(["run", "--mpi", "-np", "2", "--mpi-args=--oversubscribe", "python", "-c", script]).stdout
    assert sorted(records(out, "RESULT")) == ["0 2 True 0 3.0", "1 2 True 1 3.0"], out
    refused = hora_cli(["run", "-np", "2", "--mpi-args=-v", "python", "-c", "pass"], check=False)
    assert refused.returncode == 2 and "--mpi-args is passed to mpirun, so it needs --mpi" in refused.stderr


def _ranks_and_sum() -> tuple[int, int, bool, float]:
    import numpy as np

    hora.init()
    return hora.rank(), hora.size(), hora.mpi_enabled(), float(hora.allreduce(np.array([2.0]), op=hora.Sum)[0])


def _fails_on_rank_1() -> None:
    import hora

    hora.init()
    if hora.rank() == 1:
        raise KeyError("rank 1's own failure")


@pytest.mark.timeout(300)
def test_hora_run_use_mpi_returns_results_and_raises_a_ranks_exception() -> None:
    assert hora.run(_ranks_and_sum, np=3, use_mpi=True, mpi_args="--oversubscribe") == [
        (0, 3, True, 6.0), (1, 3, True, 6.0), (2, 3, True, 6.0)]
    with pytest.raises(KeyError, match="rank 1's own failure") as info:
        hora.run(_fails_on_rank_1, np=2, use_mpi=True, mpi_args="--oversubscribe")
    assert info.value.hora_rank == 1
    with pytest.raises(ValueError, match="mpi_args is given without use_mpi"):
        hora.run(_ranks_and_sum, np=2, mpi_args="--oversubscribe")


def _survivor_records(out_dir: Path, proc) -> dict[int, dict]:
    found = {}
    for survivor in (0, 1):
        path = out_dir / f"rank{survivor}.json"
        if path.exists():
            found[survivor] = json.loads(path.read_text())
    killed_at = float((out_dir / "killed_at").read_text())
    for survivor, seen in found.items():
        why = f"rank {survivor}: {seen}\n{proc.stderr[-3000:]}"
        assert seen["is_internal"] and seen["type"] in ("HorovodInternalError", "PeerFailureError"), why
        assert "rank 2" in seen["message"] and any(w in seen["message"] for w in ("died", "crashed")), why
        assert seen["at"] - killed_at < 10.0, why  # well inside the transport timeout (30 s)
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["auto", "mpi"])
def test_a_killed_rank_fails_every_survivor_with_horovod_internal_error(tmp_path: Path, transport: str) -> None:
    """Under --enable-recovery mpirun leaves the survivors running, so each must raise on its own."""
    proc = mpirun(3, [str(HERE / "mpi_kill_script.py"), str(tmp_path)], {"HORA_TRANSPORT": transport},
                  check=False, timeout=200, mpirun_args=("--enable-recovery",))
    # (mpirun --enable-recovery exits 0 even so: the survivors' records are what counts)
    found = _survivor_records(tmp_path, proc)
    assert sorted(found) == [0, 1], f"survivors that raised: {sorted(found)}\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(300)
def test_under_plain_mpirun_a_dead_rank_ends_the_job_promptly(tmp_path: Path) -> None:
    """Open MPI's default: mpirun itself ends the job when a rank dies; survivors that got to raise
    first (usually all of them) raised HorovodInternalError naming the dead rank."""
    started = time.monotonic()
    proc = mpirun(3, [str(HERE / "mpi_kill_script.py"), str(tmp_path)], check=False, timeout=200)
    assert proc.returncode != 0 and time.monotonic() - started < 150
    assert "exited on signal 9" in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert _survivor_records(tmp_path, proc), f"no survivor raised before mpirun ended the job:\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(200)
def test_an_unhandled_exception_on_one_rank_aborts_the_mpi_job() -> None:
    """Rank 0 waits in MPI_Barrier for rank 1, which raised: without the abort mpirun never ends."""
    started = time.monotonic()
    proc = mpirun(2, [str(HERE / "mpi_raise_script.py"), "wait"], check=False, timeout=120)
    took = time.monotonic() - started
    err = proc.stderr
    assert proc.returncode != 0 and took < 60, f"exit {proc.returncode} after {took:.0f} s\n{err[-3000:]}"
    assert "ValueError: raised on purpose by rank 1" in err, err[-3000:]  # the traceback comes first
    assert re.search(r"hora: MPI rank 1 on \S+ ended with an unhandled exception \(ValueError: raised on "
                     r"purpose by rank 1\); aborting the MPI job", err), err[-3000:]


@pytest.mark.timeout(200)
def test_hora_mpi_abort_on_exception_0_keeps_mpis_default() -> None:
    proc = mpirun(2, [str(HERE / "mpi_raise_script.py"), "leave"], {"HORA_MPI_ABORT_ON_EXCEPTION": "0"},
                  check=False, timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "ValueError: raised on purpose by rank 1" in proc.stderr, proc.stderr[-3000:]
    assert "aborting the MPI job" not in proc.stderr and "MPI_ABORT" not in proc.stderr, proc.stderr[-3000:]
