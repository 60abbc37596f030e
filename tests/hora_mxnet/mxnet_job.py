"""Starts an MXNet test job from the main test process: the venv's Python runs mxnet_driver.py."""

from __future__ import annotations

import os
import pickle
import subprocess
import tempfile

import mxnet_venv
from sections import JobResults

HERE = os.path.dirname(os.path.abspath(__file__))
JOB_TIMEOUT_S = 240


def run_job(func_name: str, np: int) -> JobResults:
    """Run ``mxnet_jobs.<func_name>``'s sections on ``np`` workers in the MXNet venv."""
    exe = mxnet_venv.python()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pkl")
        proc = subprocess.run([exe, os.path.join(HERE, "mxnet_driver.py"), func_name, str(np), out],
                              env=mxnet_venv.env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        if proc.returncode != 0 or not os.path.exists(out):
            raise AssertionError(f"MXNet job {func_name} on {np} ranks exited {proc.returncode}\n"
                                 f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
        with open(out, "rb") as f:
            return JobResults(pickle.load(f))
