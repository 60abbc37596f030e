"""The virtual environment the MXNet tests run in, created once and cached outside the repository.

MXNet 1.9.1 (its last release) needs numpy<1.24, which the main environment's TensorFlow cannot
share. The tests therefore run their MXNet jobs with another Python: a venv holding MXNet, numpy
1.23, hora's core dependencies and this checkout of hora (editable, so it tests the code here).
It lives under ``$HORA_MXNET_VENV_CACHE`` (default ``~/.cache/hora``), in a directory named after a
hash of what it holds, and is reused while that stays the same; a half-built one (no marker file)
is rebuilt. Nothing is skipped when it cannot be built: the tests fail, saying which step failed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What the venv holds besides hora itself. ml_dtypes and cloudpickle are hora's own dependencies
#: (pyproject.toml); scikit-learn brings the digits data for the example.
REQUIREMENTS = ["mxnet==1.9.1", "numpy<1.24", "ml_dtypes>=0.3", "cloudpickle>=2.0", "scikit-learn>=1.0"]
INSTALL_TIMEOUT_S = 900
_MARKER = "hora-venv-complete"


def venv_dir() -> Path:
    key = "\n".join([sys.version, str(ROOT), *REQUIREMENTS]).encode()
    base = Path(os.environ.get("HORA_MXNET_VENV_CACHE", Path.home() / ".cache" / "hora"))
    return base / f"mxnet-venv-{hashlib.sha256(key).hexdigest()[:12]}"


def _run(step: str, command: list[str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"building the MXNet test venv failed at {step}: {' '.join(command)} exited "
                           f"{proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def python() -> str:
    """The venv's Python, building the venv first if needed (several pytest processes may ask at once)."""
    target = venv_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    exe = target / "bin" / "python"
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _MARKER).exists():
            shutil.rmtree(target, ignore_errors=True)
            _run("venv creation", [sys.executable, "-m", "venv", str(target)])
            _run("installing MXNet", [str(exe), "-m", "pip", "install", "--quiet", "--no-compile", *REQUIREMENTS])
            _run("installing hora", [str(exe), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT)])
            _run("importing MXNet", [str(exe), "-c", "import mxnet, hora.mxnet; mxnet.nd.ones(2).asnumpy()"])
            (target / _MARKER).write_text("\n".join(REQUIREMENTS) + "\n")
    return str(exe)


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a command run with the venv's Python: its bin first on PATH (``hora run
    ... python`` then starts workers in the venv), no hora identity variables, one compute thread."""
    bin_dir = str(Path(python()).parent)
    out = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_")) and k != "PYTHONPATH"}
    out.update({"PATH": bin_dir + os.pathsep + out.get("PATH", ""), "OMP_NUM_THREADS": "1",
                "MXNET_CPU_WORKER_NTHREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})})
    return out
