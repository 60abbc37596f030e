"""The elastic examples run end to end under the elastic launcher, on 2 workers, in a few epochs.

Each test starts the real launcher (``python -m hora run -np 2 --min-np 1 --max-np 2 ...``) in a
subprocess and checks the lines a user would look at: each epoch's world size and test accuracy,
and the final accuracy. The second test of each example kills one worker partway through and checks
that the other re-forms the world alone and finishes the training. The examples are
examples/elastic/pytorch_mnist_elastic.py (a custom loop and TorchState) and
examples/elastic/tensorflow2_keras_mnist_elastic.py (model.fit, KerasState and the elastic callbacks).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from job_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = "examples/elastic/pytorch_mnist_elastic.py"
TIMEOUT_S = 240
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)

_EPOCH = re.compile(r"^\[0\]<stdout>:Epoch (\d+): (\d+) worker\(s\), test loss [0-9.]+, accuracy ([0-9.]+)%$",
                    re.MULTILINE)
_FINAL = re.compile(r"^\[0\]<stdout>:Final test accuracy: ([0-9.]+)% after (\d+) epoch\(s\) on (\d+) worker\(s\)",
                    re.MULTILINE)


@pytest.fixture(autouse=True)
def _needs_torch_and_sklearn() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")


def _epochs(out: str) -> list[tuple[int, int, float]]:
    """(epoch, workers, test accuracy) of every epoch rank 0 reported."""
    return [(int(e), int(n), float(a)) for e, n, a in _EPOCH.findall(out)]


def _final(out: str) -> tuple[float, int, int]:
    """(test accuracy, epochs, workers) of the final line."""
    found = _FINAL.findall(out)
    assert len(found) == 1, out
    accuracy, epochs, workers = found[0]
    return float(accuracy), int(epochs), int(workers)


def test_pytorch_mnist_elastic_trains_on_a_fixed_host_list():
    proc = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", "--min-np", "1", "--max-np", "2", "-H", "localhost:2",
         "python", EXAMPLE, "--epochs", "3"],
        cwd=ROOT, env=clean_env(ENV), capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "[0]<stdout>:Training on 2 worker(s): 1437 training and 360 test images of 8x8 digits" in out, out
    assert [(e, n) for e, n, _ in _epochs(out)] == [(1, 2), (2, 2), (3, 2)], out
    accuracy, epochs, workers = _final(out)
    assert (epochs, workers) == (3, 2), out
    assert accuracy > 80.0, out  # 10 digits: chance is 10%
    assert "World re-formed" not in out, out  # nothing changed, nothing was reset
    # Only rank 0 prints progress.
    assert not [line for line in out.splitlines() if line.startswith("[1]<stdout>:")], out


def _run_and_kill_the_worker_on_127_0_0_1(example: str, epochs: int, env: dict[str, str]) -> tuple[int, str]:
    """Run ``example`` for ``epochs`` on two workers on two "hosts" of this machine (``-H
    localhost:1,127.0.0.1:1 --min-np 1``) and SIGKILL the one on 127.0.0.1 once rank 0 reported its
    first epoch; the launcher's exit status and output (stdout and stderr, as they came)."""
    lines: list[str] = []
    changed = threading.Condition()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hora", "run", "--verbose", "-np", "2", "--min-np", "1", "--max-np", "2",
         "-H", "localhost:1,127.0.0.1:1", "python", example, "--epochs", str(epochs)],
        cwd=ROOT, env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with changed:
                lines.append(line.rstrip("\n"))
                changed.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_for(pattern: str) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + TIMEOUT_S
        with changed:
            while True:
                found = next((m for m in map(regex.search, lines) if m), None)
                if found:
                    return found
                if time.monotonic() > deadline or (proc.poll() is not None and not reader.is_alive()):
                    pytest.fail(f"no line matching {pattern!r}:\n" + "\n".join(lines[-100:]))
                changed.wait(0.5)

    try:
        pid = int(wait_for(r"started rank 1 on 127\.0\.0\.1 \(pid (\d+)\)").group(1))
        wait_for(r"^\[0\]<stdout>:Epoch 1: 2 worker\(s\)")
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT_S)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the launcher stops its workers
            proc.wait(timeout=30)
    return proc.returncode, "\n".join(lines)


def test_pytorch_mnist_elastic_goes_on_alone_when_the_other_worker_is_killed():
    """Two workers on two "hosts" of this machine; the one on 127.0.0.1 is killed after the first
    epoch. Its host is blacklisted, and the worker on localhost rolls back to its last commit,
    re-forms the world alone and trains to the end."""
    returncode, out = _run_and_kill_the_worker_on_127_0_0_1(EXAMPLE, 4, ENV)
    assert returncode == 0, out
    assert "[0]<stdout>:World re-formed: 1 worker(s), learning rate 0.05" in out, out
    epochs = _epochs(out)
    assert [e for e, _, _ in epochs] == [1, 2, 3, 4], out
    assert epochs[0][1] == 2 and epochs[-1][1] == 1, out
    accuracy, epochs_done, workers = _final(out)
    assert (epochs_done, workers) == (4, 1), out
    assert accuracy > 80.0, out


# ---- examples/elastic/tensorflow2_keras_mnist_elastic.py: model.fit with the elastic Keras callbacks --------

KERAS_EXAMPLE = "examples/elastic/tensorflow2_keras_mnist_elastic.py"
# TensorFlow kept quiet and held to one compute thread per worker (the CI box has two cores).
KERAS_ENV = {**ENV, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1",
             "TF_NUM_INTEROP_THREADS": "2"}

_KERAS_EPOCH = re.compile(r"^\[0\]<stdout>:Epoch (\d+): (\d+) worker\(s\), loss [0-9.]+, accuracy [0-9.]+%, "
                          r"test accuracy ([0-9.]+)%$", re.MULTILINE)


def _keras_epochs(out: str) -> list[tuple[int, int, float]]:
    """(epoch, workers, test accuracy) of every epoch rank 0 reported."""
    return [(int(e), int(n), float(a)) for e, n, a in _KERAS_EPOCH.findall(out)]


def _needs_tensorflow_keras() -> None:
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")


def test_tensorflow2_keras_mnist_elastic_trains_on_a_fixed_host_list():
    _needs_tensorflow_keras()
    proc = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", "--min-np", "1", "--max-np", "2", "-H", "localhost:2",
         "python", KERAS_EXAMPLE, "--epochs", "3"],
        cwd=ROOT, env=clean_env(KERAS_ENV), capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert re.search(r"^\[0\]<stdout>:Training on 2 worker\(s\) \(Keras [^)]*tensorflow backend.*\): "
                     r"1437 training and 360 test images of 8x8 digits$", out, re.MULTILINE), out
    epochs = _keras_epochs(out)
    assert [(e, n) for e, n, _ in epochs] == [(1, 2), (2, 2), (3, 2)], out
    assert epochs[-1][2] > 80.0, out  # 10 digits: chance is 10%
    accuracy, epochs_done, workers = _final(out)
    assert (epochs_done, workers) == (3, 2), out
    assert accuracy > 80.0, out
    assert "[0]<stdout>:weights identical on all 2 workers: True" in out, out
    assert "World re-formed" not in out, out  # nothing changed, nothing was reset
    # Only rank 0 prints progress.
    assert not [line for line in out.splitlines() if line.startswith("[1]<stdout>:")], out


def test_tensorflow2_keras_mnist_elastic_goes_on_alone_when_the_other_worker_is_killed():
    """As the torch example's test: the worker on 127.0.0.1 is killed after the first epoch; the one on
    localhost rolls back to its last commit (the failed collective comes out of fit's compiled step),
    re-forms the world alone, rescales the learning rate and trains the epochs left."""
    _needs_tensorflow_keras()
    epochs_asked = 8  # the epochs after the first take seconds: the kill lands long before the end
    returncode, out = _run_and_kill_the_worker_on_127_0_0_1(KERAS_EXAMPLE, epochs_asked, KERAS_ENV)
    assert returncode == 0, out
    assert "[0]<stdout>:World re-formed: 1 worker(s), learning rate 0.002" in out, out
    epochs = _keras_epochs(out)
    # Every epoch reported once: an epoch's line comes after its metrics were averaged over both
    # workers, so an epoch the kill interrupted is reported only when it is trained again, alone.
    assert [e for e, _, _ in epochs] == list(range(1, epochs_asked + 1)), out
    assert epochs[0][1] == 2 and epochs[-1][1] == 1, out
    accuracy, epochs_done, workers = _final(out)
    assert (epochs_done, workers) == (epochs_asked, 1), out
    assert accuracy > 80.0, out
