"""What ``hora check`` and ``hora run --mpi`` say about the transports this machine can actually run.

mpi4py is made unimportable for real: the child Python runs with a directory first on PYTHONPATH that
holds an ``mpi4py`` package whose import raises, the error a removed install (ModuleNotFoundError) or
a broken one (ImportError) gives. Everything else is the real thing: the real ``hora`` command, the
real ``mpirun`` when it is installed, and the real mpi4py where this machine has it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from job_env import clean_env

pytestmark = pytest.mark.timeout(120)

HORA = [sys.executable, "-m", "hora"]
INSTALL = 'pip install "hora[mpi]"'
# How a missing package and a broken one fail to import.
NOT_INSTALLED = "raise ModuleNotFoundError(\"No module named 'mpi4py'\", name='mpi4py')\n"
BROKEN = "raise ImportError('mpi4py is broken in this environment (removed on purpose by the test)')\n"


def _env_without_mpi4py(root: Path, body: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python finds a stand-in ``mpi4py`` package (raising ``body``) first."""
    package = root / "shadow" / "mpi4py"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(body)
    search = [str(root / "shadow")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return clean_env({"PYTHONPATH": os.pathsep.join(search), **(extra or {})})


def _mpi4py_loads() -> bool:
    """Whether mpi4py and its MPI library load here (without initialising MPI)."""
    program = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI"
    return subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=60).returncode == 0


def _transport_lines(env: dict[str, str]) -> dict[str, str]:
    """``hora check``'s transport lines, by transport name."""
    done = subprocess.run([*HORA, "check"], capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    section = done.stdout.split("Available transports:\n", 1)[1].split("\n\n", 1)[0]
    lines = {}
    for line in section.splitlines():
        if not line.startswith("    "):  # the NCCL line's own detail lines are indented further
            name, _, verdict = line.strip().partition(": ")
            lines[name] = verdict
    return lines


def _tripwire_mpirun(root: Path) -> tuple[Path, Path]:
    """An ``mpirun`` for HORA_MPIRUN that leaves a mark when started, then runs the real one: the
    proof of whether the launcher got as far as starting mpirun."""
    mark = root / "mpirun-was-started"
    script = root / "mpirun"
    script.write_text(f"#!/bin/sh\ntouch '{mark}'\nexec mpirun \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, mark


@pytest.mark.parametrize("body, why", [
    (NOT_INSTALLED, f"mpi4py is not installed: {INSTALL}"),
    (BROKEN, "mpi4py does not import (mpi4py is broken in this environment (removed on purpose by the "
             "test)): reinstall mpi4py: pip install --force-reinstall --no-cache-dir mpi4py"),
], ids=["not-installed", "broken"])
def test_check_says_mpi_is_unusable_and_why_when_mpi4py_does_not_import(tmp_path, body, why):
    lines = _transport_lines(_env_without_mpi4py(tmp_path, body))
    assert lines["mpi"] == f"no ({why})"
    assert lines["tcp ring"] == "yes"
    assert set(lines) >= {"tcp ring", "shm", "hierarchical", "mpi"}


def test_check_says_mpi_is_unusable_when_mpi4py_imports_but_its_mpi_library_does_not_load(tmp_path):
    """mpi4py's package imports but its ``MPI`` extension cannot load its library (what a missing
    libmpi looks like): the check loads it in a child Python, as a rank would, and says so."""
    env = _env_without_mpi4py(tmp_path, "class _Rc:\n    pass\n\nrc = _Rc()\n")
    missing = "libmpi.so.40: cannot open shared object file: No such file or directory"
    (tmp_path / "shadow" / "mpi4py" / "MPI.py").write_text(f"raise ImportError({missing!r})\n")
    lines = _transport_lines(env)
    assert lines["mpi"].startswith(f"no (mpi4py cannot load an MPI library (ImportError: {missing}): "
                                   "install Open MPI or MPICH"), lines["mpi"]


@pytest.mark.skipif(not _mpi4py_loads(), reason="mpi4py (with an MPI library) is not installed here")
def test_check_says_mpi_is_usable_where_mpi4py_loads():
    lines = _transport_lines(clean_env())
    assert lines["mpi"] == "yes"


def test_check_reports_shm_and_hierarchical_from_a_real_segment():
    """/dev/shm is writable here, so both say yes; the check is the transport's own segment creation."""
    from hora.transport import unavailable_reason

    expected = "yes" if unavailable_reason("shm") is None else "no ("
    lines = _transport_lines(clean_env())
    assert lines["shm"].startswith(expected) and lines["hierarchical"].startswith(expected)
    assert unavailable_reason("nonesuch") == ("unknown transport 'nonesuch'; available: hierarchical, mpi, "
                                              "shm, tcp")


def test_hora_run_mpi_without_mpi4py_stops_with_one_line_before_starting_mpirun(tmp_path):
    mpirun, mark = _tripwire_mpirun(tmp_path)
    env = _env_without_mpi4py(tmp_path, NOT_INSTALLED, {"HORA_MPIRUN": str(mpirun)})
    command = [*HORA, "run", "--mpi", "-np", "2", sys.executable, "-c", "import hora; hora.init()"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("hora run: error: ") and "mpi4py is not installed" in lines[0], lines[0]
    assert INSTALL in lines[0] and "HORA_TRANSPORT=tcp" in lines[0], lines[0]
    assert not mark.exists(), "mpirun was started"


def test_hora_run_use_mpi_without_mpi4py_raises_config_error_before_starting_mpirun(tmp_path):
    mpirun, mark = _tripwire_mpirun(tmp_path)
    env = _env_without_mpi4py(tmp_path, NOT_INSTALLED, {"HORA_MPIRUN": str(mpirun)})
    program = tmp_path / "launch.py"
    program.write_text(textwrap.dedent("""
        import hora
        from hora.errors import ConfigError

        def work():
            hora.init()
            return hora.rank()

        try:
            hora.run(work, np=2, use_mpi=True)
        except ConfigError as exc:
            print(f"RAISED {type(exc).__name__} {isinstance(exc, ValueError)} {exc}")
    """))
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=60, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    raised = [line for line in done.stdout.splitlines() if line.startswith("RAISED ")]
    assert len(raised) == 1, output
    assert raised[0].startswith("RAISED ConfigError True hora.run: "), raised[0]  # Horovod raises ValueError
    assert "mpi4py is not installed" in raised[0] and INSTALL in raised[0], raised[0]
    assert not mark.exists(), "mpirun was started"


@pytest.mark.skipif(not __import__("shutil").which("mpirun"), reason="mpirun is not installed")
def test_hora_run_mpi_without_mpi4py_runs_on_hora_transport_when_asked(tmp_path):
    """The way out the error names: HORA_TRANSPORT=tcp starts the ranks through mpirun anyway."""
    env = _env_without_mpi4py(tmp_path, NOT_INSTALLED, {"HORA_TRANSPORT": "tcp"})
    script = ("import sys, numpy as np, hora; hora.init(); "
              "s = hora.allreduce(np.array([1.0 + hora.rank()]), op=hora.Sum)[0]; "
              "sys.stdout.write(f'RESULT {hora.rank()} {hora.size()} {s}\\n')")
    command = [*HORA, "run", "--mpi", "-np", "2", "--mpi-args=--oversubscribe", sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = sorted(line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT " in line)
    assert results == ["0 2 3.0", "1 2 3.0"], done.stdout + done.stderr


# ---- hora.mpi_built() tells the same truth as hora check -------------------------------------------

def _mpi_built(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", "import hora; print(hora.mpi_built())"], capture_output=True,
                          text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("body, library", [(NOT_INSTALLED, None), (BROKEN, None),
                                           ("class _Rc:\n    pass\n\nrc = _Rc()\n", "libmpi.so.40: cannot open")],
                         ids=["not-installed", "broken", "no-mpi-library"])
def test_mpi_built_is_false_where_mpi_cannot_be_used(tmp_path, body, library):
    """Horovod's mpi_built() says whether MPI can be used; a script that checks it before asking for
    MPI must not be told yes by an mpi4py whose import, or whose MPI library, fails (hora check: no)."""
    env = _env_without_mpi4py(tmp_path, body)
    if library is not None:
        (tmp_path / "shadow" / "mpi4py" / "MPI.py").write_text(f"raise ImportError({library!r})\n")
    assert _mpi_built(env) == "False"


@pytest.mark.skipif(not _mpi4py_loads(), reason="mpi4py (with an MPI library) is not installed here")
def test_mpi_built_is_true_where_mpi4py_loads():
    assert _mpi_built(clean_env()) == "True"
