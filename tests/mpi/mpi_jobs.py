"""Starting real Open MPI jobs from tests: ``mpirun`` with a clean environment and a time-out.

Tests run as root in CI, which Open MPI refuses unless told (OMPI_ALLOW_RUN_AS_ROOT*), and on two
cores, so every job is ``--oversubscribe``d. The hora variables of the shell running pytest never
leak into the ranks (job_env.clean_env).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from job_env import clean_env

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MPIRUN = shutil.which("mpirun")


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = clean_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                     "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "OMPI_MCA_rmaps_base_oversubscribe": "1"})
    paths = [str(ROOT / "src"), str(HERE), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(extra or {})
    return env


def mpirun(np: int, args: list[str], extra_env: dict[str, str] | None = None, timeout: float = 150,
           check: bool = True, mpirun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``mpirun -np N [MPIRUN_ARGS] python ARGS...`` from the repository root; asserts success when
    ``check``."""
    assert MPIRUN, "mpirun is not installed (apt-get install openmpi-bin)"
    argv = [MPIRUN, "-np", str(np), "--oversubscribe", "--bind-to", "none", *mpirun_args, sys.executable, *args]
    proc = _run_job(argv, mpi_env(extra_env), timeout)
    if check:
        assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                                      f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def _run_job(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run mpirun in a session of its own: on a time-out the whole job (mpirun and every rank it
    started) is ended, and the failure shows what the ranks printed. Killing mpirun alone would
    leave its ranks spinning in MPI calls for the rest of the test run."""
    child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, err = child.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            out, err = "", ""
        raise AssertionError(f"{' '.join(argv)} did not end within {timeout:.0f} s (the job was killed)\n"
                             f"stdout:\n{out[-4000:]}\nstderr:\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def hora_cli(args: list[str], extra_env: dict[str, str] | None = None, timeout: float = 150,
             check: bool = True) -> subprocess.CompletedProcess:
    """``python -m hora ARGS...`` from the repository root."""
    proc = subprocess.run([sys.executable, "-m", "hora", *args], cwd=ROOT, env=mpi_env(extra_env),
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                                      f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def records(out: str, tag: str) -> list[str]:
    """The lines a job script printed with ``TAG `` in front (whatever prefix mpirun added)."""
    found = []
    for line in out.splitlines():
        at = line.find(tag + " ")
        if at >= 0:
            found.append(line[at + len(tag) + 1:])
    return found
