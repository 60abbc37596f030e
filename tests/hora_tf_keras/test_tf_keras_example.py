"""examples/tf_keras_mnist.py under `hora run -np 2`: Keras 2 reaches >= 95% on the digits test set,
with the legacy optimizer (Keras 2's `lr=`), and rank 0 alone keeps the best model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from job_env import clean_env

pytest.importorskip("tf_keras")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_tf_keras_mnist_reaches_95_percent_on_two_workers(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    env = clean_env({"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"})
    proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", "python", "examples/tf_keras_mnist.py",
                           "--epochs", "8", "--legacy-optimizer", "--checkpoint-dir", str(checkpoints)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    rank0 = [line.split(":", 1)[1] for line in out.splitlines() if line.startswith("[0]<stdout>:")]
    assert any("tf_keras 2." in line and "legacy.adam.Adam" in line for line in rank0), out
    assert "weights identical on all 2 workers: True" in rank0, out
    final = re.search(r"Final test accuracy: ([0-9.]+)% \(loss [0-9.]+\) after 8 epoch\(s\)", out)
    assert final and float(final.group(1)) >= 95.0, out
    assert os.listdir(checkpoints) == ["best.h5"]  # BestModelCheckpoint: one file, written by rank 0
    assert not any(line.startswith("[1]<stdout>:") and "Epoch" in line for line in out.splitlines()), out
