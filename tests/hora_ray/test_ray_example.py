"""The Ray examples train the digits model to the accuracy ``hora run`` reaches.

examples/ray/pytorch_mnist_ray.py runs examples/pytorch_mnist.py's training through RayExecutor on 2
workers; the same seed, epochs and threads under ``hora run -np 2`` (started alongside, in a
subprocess) must reach the same test accuracy, within one point. examples/ray/pytorch_mnist_ray_elastic.py
does the same for examples/elastic/pytorch_mnist_elastic.py through ElasticRayExecutor (1 to 2
workers, on a Ray node of 4 CPUs, the local instance shared with test_ray_executor.py: one world of
2), against ``hora run -np 2 --min-np 1 --max-np 2``.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("sklearn")

from job_env import clean_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINING = ["--epochs", "2", "--seed", "42", "--num-threads", "1", "--log-interval", "1000"]


@pytest.fixture(scope="module")
def ray_instance(ray_local):
    """The local Ray instance of conftest.py (4 CPUs), shared with test_ray_executor.py."""
    return ray_local


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


def _wait_for_free_cpus(cpus: float, timeout: float = 30.0) -> None:
    """Until Ray shows ``cpus`` CPUs free (at once, as measured here, but an earlier test's actors may
    give theirs back late): the elastic job's first world is as big as the free CPUs it first finds."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0.0) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)


def test_elastic_ray_example_matches_elastic_hora_run_accuracy(ray_instance, monkeypatch, capsys):
    _wait_for_free_cpus(2)
    baseline = subprocess.Popen(
        [sys.executable, "-m", "hora", "run", "-np", "2", "--min-np", "1", "--max-np", "2", "-H", "localhost:2",
         "python", "examples/elastic/pytorch_mnist_elastic.py", *TRAINING],
        cwd=ROOT, env=clean_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        monkeypatch.syspath_prepend(os.path.join(ROOT, "examples", "ray"))
        example = importlib.import_module("pytorch_mnist_ray_elastic")
        accuracy = 100.0 * example.main(["--min-workers", "1", "--max-workers", "2", "--timeout-s", "60",
                                         "--elastic-timeout", "60", *TRAINING])
        out, _ = baseline.communicate(timeout=110)
    finally:
        if baseline.poll() is None:
            baseline.kill()
            baseline.wait()
        for name in ("pytorch_mnist_ray_elastic", "pytorch_mnist_elastic", "pytorch_mnist"):
            sys.modules.pop(name, None)
    assert baseline.returncode == 0, out[-3000:]
    printed = capsys.readouterr().out
    # The node's free CPUs hold both workers from the start: one world, never re-formed, as under hora run.
    assert re.search(r"ElasticRayExecutor.run returned: test accuracy [0-9.]+% after 2 epoch\(s\) on 2 worker\(s\), "
                     r"[0-9.]+ s in all; rendezvous rounds 1 \(world sizes 2\), resets 0, worker failures 0",
                     printed), printed
    found = re.search(r"\[0\]<stdout>:Final test accuracy: ([0-9.]+)% after 2 epoch\(s\) on 2 worker\(s\)", out)
    assert found, out[-3000:]
    assert "World re-formed" not in out, out[-3000:]
    expected = float(found.group(1))
    print(f"\ndigits, 2 epochs, 1 to 2 workers (elastic): ElasticRayExecutor {accuracy:.2f}%, "
          f"hora run {expected:.2f}%")
    assert expected > 50.0, out[-3000:]  # 10 digits: chance is 10%
    assert abs(accuracy - expected) <= 1.0
