"""examples/mxnet_gluon_mnist.py under `hora run -np 2` in the MXNet venv reaches >= 95% on the digits, and
benchmarks/mxnet_vs_kvstore.py runs end to end in a tiny configuration."""

from __future__ import annotations

import json
import re
import subprocess

import mxnet_venv
import pytest

pytestmark = pytest.mark.timeout(1200)  # the first test may build the MXNet venv (pip, once per cache)


def test_mxnet_gluon_mnist_two_workers():
    exe = mxnet_venv.python()
    proc = subprocess.run([exe, "-m", "hora", "run", "-np", "2", "python", "examples/mxnet_gluon_mnist.py"],
                          cwd=str(mxnet_venv.ROOT), env=mxnet_venv.env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>:Test set")]
    assert lines, proc.stdout[-3000:]
    accuracy = float(re.search(r"Accuracy: ([0-9.]+)%", lines[-1]).group(1))
    assert accuracy >= 95.0, lines[-1]
    assert "on 2 workers" in lines[-1]
    assert not any(line.startswith("[1]<stdout>:Test set") for line in proc.stdout.splitlines())


def test_mxnet_vs_kvstore_benchmark_tiny():
    exe = mxnet_venv.python()
    proc = subprocess.run([exe, "benchmarks/mxnet_vs_kvstore.py", "--rounds", "1", "--iters", "2", "--warmup", "1",
                           "--hidden", "32", "--json"], cwd=str(mxnet_venv.ROOT), env=mxnet_venv.env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["samples_per_sec"]) == {"hora", "device", "local", "single"}
    assert all(rate > 0 for rate in result["samples_per_sec"].values())
    assert result["hora_over_device"] > 0
