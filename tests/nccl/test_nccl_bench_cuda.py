"""``hora bench --api torch-cuda`` (the NCCL busbw sweep of a GPU machine) on a machine without a GPU:
a one-line error naming the host and why, and a non-zero exit, rather than a traceback or a hang."""

from __future__ import annotations

import subprocess
import sys

import pytest
from job_env import clean_env

pytestmark = pytest.mark.timeout(120)


def test_torch_cuda_sweep_without_a_gpu_says_why():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the sweep would run (tests/nccl/test_nccl_gpu.py covers NCCL)")
    done = subprocess.run([sys.executable, "-m", "hora", "bench", "--api", "torch-cuda", "-np", "1",
                           "-b", "4", "-e", "4"], capture_output=True, text=True, env=clean_env(), timeout=100)
    assert done.returncode == 1, done.stderr
    assert "hora bench: error:" in done.stderr and "needs a CUDA GPU on every rank" in done.stderr
    assert "torch.cuda.is_available() is False" in done.stderr
