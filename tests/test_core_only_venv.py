"""The README's bare test command on a machine that has only hora's core: every module collects or
skips, naming what it lacks; none errors.

A fresh venv gets ``pip install -e ".[test]"`` (numpy, ml_dtypes, cloudpickle, pytest and the test
extra: no torch, TensorFlow, JAX, Ray, Spark, MPI...), then pytest collects the whole suite in it.
Before the test folders were renamed, ``tests/ray`` stood in for the missing ``ray`` and 5 modules
failed to collect (435 tests).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What the core venv must not have; if the test extra ever pulls one in, this test says so.
FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "ray", "pyspark", "lightning", "mxnet", "mpi4py")


def _run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


@pytest.fixture(scope="module")
def core_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    venv = tmp_path_factory.mktemp("core-venv")
    created = _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    assert created.returncode == 0, created.stderr
    python = str(venv / "bin" / "python")
    # --no-compile: byte-compiling scikit-learn and SciPy whole took most of the install; the
    # collection compiles the little it imports.
    installed = _run([python, "-m", "pip", "install", "--quiet", "--no-compile", "-e", f"{ROOT}[test]"], timeout=600)
    assert installed.returncode == 0, f"pip install -e .[test] failed:\n{installed.stdout}\n{installed.stderr}"
    return python


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_suite_collects_without_errors_where_only_the_core_is_installed(core_python: str) -> None:
    present = _run([core_python, "-c", "import importlib.util as u, sys; "
                    f"print([m for m in {FRAMEWORKS!r} if u.find_spec(m)])"], timeout=60, cwd=ROOT)
    assert present.stdout.strip() == "[]", f"the core venv has frameworks: {present.stdout}{present.stderr}"
    collected = _run([core_python, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider"],
                     timeout=600, cwd=ROOT)
    tail = collected.stdout[-4000:]
    assert collected.returncode == 0, (f"collection failed (exit {collected.returncode}):\n{tail}\n"
                                       f"{collected.stderr[-2000:]}")
    summary = collected.stdout.strip().splitlines()[-1]
    assert "error" not in summary, summary
    assert re.search(r"\d+ tests? collected", summary), summary
    # The modules that skipped say what they need.
    skips = [line for line in collected.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips, "no module skipped in a venv without torch, TensorFlow, JAX, Ray or Spark"
    assert all(re.search(r"could not import|not installed|needs|requires|No module named", s) for s in skips), \
        "\n".join(s for s in skips if not re.search(r"could not import|not installed|needs|requires", s))
    assert any("torch" in s for s in skips) and any("ray" in s for s in skips), "\n".join(skips)
