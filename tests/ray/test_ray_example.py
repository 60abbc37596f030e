"""examples/ray/pytorch_mnist_ray.py trains the digits model to the accuracy ``hora run`` reaches.

The Ray example runs examples/pytorch_mnist.py's training through RayExecutor on 2 workers;
the same seed, epochs and threads under ``hora run -np 2`` (started alongside, in a subprocess) must
reach the same test accuracy, within one point.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("sklearn")

from job_env import clean_env  # noqa: E402
from ray_testing import local_ray  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINING = ["--epochs", "2", "--seed", "42", "--num-threads", "1", "--log-interval", "1000"]


@pytest.fixture(scope="module")
def ray_instance():
    with local_ray(2) as instance:
        yield instance


def test_ray_example_matches_hora_run_accuracy(ray_instance, monkeypatch, capsys):
    baseline = subprocess.Popen(
        [sys.executable, "-m", "hora", "run", "-np", "2", "python", "examples/pytorch_mnist.py", *TRAINING],
        cwd=ROOT, env=clean_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        # The example as a module of its own directory, so the workers import its training function.
        monkeypatch.syspath_prepend(os.path.join(ROOT, "examples", "ray"))
        example = importlib.import_module("pytorch_mnist_ray")
        accuracy = 100.0 * example.main(["--num-workers", "2", *TRAINING])
        out, _ = baseline.communicate(timeout=110)
    finally:
        if baseline.poll() is None:
            baseline.kill()
            baseline.wait()
        for name in ("pytorch_mnist_ray", "pytorch_mnist"):
            sys.modules.pop(name, None)
    assert baseline.returncode == 0, out[-3000:]
    printed = capsys.readouterr().out
    assert re.search(r"Started 2 hora workers on Ray in [0-9.]+ s", printed), printed
    assert re.search(r"RayExecutor.run returned: test accuracy [0-9.]+% after 2 epoch\(s\) on 2 worker\(s\)",
                     printed), printed
    found = re.search(r"\[0\]<stdout>:Final test accuracy: ([0-9.]+)%", out)
    assert found, out[-3000:]
    expected = float(found.group(1))
    print(f"\ndigits, 2 epochs, 2 workers: RayExecutor {accuracy:.2f}%, hora run {expected:.2f}%")
    assert expected > 50.0, out[-3000:]  # 10 digits: chance is 10%
    assert abs(accuracy - expected) <= 1.0
