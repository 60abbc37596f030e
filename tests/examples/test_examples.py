"""The examples and the DDP comparison run end to end on 2 workers, in tiny configurations.

Each test starts the real launcher (`python -m hora run -np 2 ...`, or the benchmark's own driver)
in a subprocess and checks the lines a user would look at: accuracy, img/sec, ratios.

Importing TensorFlow, Keras or torch and scikit-learn costs each worker more CPU time than most of
these tiny runs, so the examples that need the same world size and environment run one after
another in ONE launch (tests/examples/example_chain.py runs each script as ``__main__``, as
``python SCRIPT`` does): a :class:`Chain` starts it for the first of its tests and hands each test
its example's lines.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 120
CHAIN = os.path.join("tests", "examples", "example_chain.py")
CHAIN_TIMEOUT_S = 4 * TIMEOUT_S  # up to four examples in one launch


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without hora identity/knob variables, one compute thread per worker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})})
    return env


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(env), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}"
                                  f"\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def _hora_run_2(script: str, *args: str) -> str:
    return _run(["-m", "hora", "run", "-np", "2", "python", script, *args]).stdout


def _rank0_lines(out: str) -> list[str]:
    return [line.split(":", 1)[1] for line in out.splitlines() if line.startswith("[0]<stdout>:")]


@dataclass(frozen=True)
class Chained:
    """One example of a chain: the test that reads it, the script and its arguments, what it imports."""

    test: str
    script: str
    args: tuple[str, ...]
    needs: tuple[str, ...]


_MARK = re.compile(r"^\[(\d+)\]<stdout>:@@example (\S+) (begin|end)(?: (.*))?$")
_PREFIX = re.compile(r"^\[(\d+)\]<stdout>:")


class Chain:
    """Examples with the same world size and environment, run one after another in one ``hora run``
    launch (each worker imports its frameworks once); each test reads its own example's lines.

    The launch covers the examples whose tests were selected (``-k``) and whose modules are
    installed, and starts when the first of those tests asks for its output; a launch that fails as
    a whole (a timeout) fails every test of the chain with its error.
    """

    def __init__(self, np: int, env: dict[str, str], members: list[Chained]) -> None:
        self.np, self.env, self.members = np, env, members
        self.outputs: dict[str, tuple[list[str], dict[str, str]]] | None = None
        self.proc: subprocess.CompletedProcess | None = None
        self.error: BaseException | None = None

    def output(self, request: pytest.FixtureRequest) -> str:
        """The stdout lines (with their ``[rank]<stdout>:`` prefixes) of the asking test's example."""
        name = request.node.name
        if self.outputs is None and self.error is None:
            selected = {item.name for item in request.session.items}
            members = [m for m in self.members if m.test == name or (
                m.test in selected and all(importlib.util.find_spec(module) for module in m.needs))]
            try:
                self._run(members)
            except BaseException as exc:  # every test of the chain fails with it
                self.error = exc
        if self.error is not None:
            raise self.error
        assert self.outputs is not None and self.proc is not None
        lines, statuses = self.outputs.get(name, ([], {}))
        out = "\n".join(lines)
        assert sorted(statuses.items()) == [(str(rank), "ok") for rank in range(self.np)], (
            f"{name}: example statuses by rank {statuses} (launch exit {self.proc.returncode})\n"
            f"its output:\n{out[-3000:]}\nthe launch's stderr:\n{self.proc.stderr[-3000:]}")
        return out

    def _run(self, members: list[Chained]) -> None:
        chain = json.dumps([[m.test, m.script, list(m.args)] for m in members])
        self.proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", str(self.np), "python", CHAIN, chain],
                                   cwd=ROOT, env=_env(self.env), capture_output=True, text=True,
                                   timeout=CHAIN_TIMEOUT_S)
        self.outputs = {}
        current: dict[str, str] = {}  # rank -> the example it is running
        for line in self.proc.stdout.splitlines():  # each rank's lines come in the order it printed them
            mark = _MARK.match(line)
            if mark:
                rank, test, what, status = mark.groups()
                self.outputs.setdefault(test, ([], {}))
                if what == "begin":
                    current[rank] = test
                else:
                    current.pop(rank, None)
                    self.outputs[test][1][rank] = status
                continue
            prefix = _PREFIX.match(line)
            if prefix and prefix.group(1) in current:
                self.outputs[current[prefix.group(1)]][0].append(line)


_SYNTHETIC_TINY = ("--num-iters", "1", "--num-batches-per-iter", "1", "--num-warmup-batches", "1", "--batch-size", "2",
                   "--image-size", "32")
_KERAS_ARGS = ("--epochs", "2", "--warmup-epochs", "1", "--fp16-allreduce")

# TensorFlow examples at -np 2; the TF1 one last, as it disables TF2 behaviour for good.
TF_CHAIN = Chain(2, {"KERAS_BACKEND": "tensorflow"}, [
    Chained("test_tensorflow2_synthetic_benchmark_tiny", "examples/tensorflow2_synthetic_benchmark.py",
            _SYNTHETIC_TINY, ("tensorflow",)),
    Chained("test_tensorflow2_mnist_gradient_tape", "examples/tensorflow2_mnist.py",
            ("--steps", "60", "--log-interval", "10"), ("tensorflow", "sklearn")),
    Chained("test_tensorflow2_keras_mnist_fit_with_callbacks[tensorflow]", "examples/tensorflow2_keras_mnist.py",
            _KERAS_ARGS, ("tensorflow", "keras", "sklearn")),
    Chained("test_tensorflow1_monitored_training_session_mnist[2]", "examples/tensorflow_mnist.py",
            ("--epochs", "4", "--log-every", "10"), ("tensorflow", "sklearn")),
])
# torch examples at -np 2, with the Keras example on Keras' torch backend.
TORCH_CHAIN = Chain(2, {"KERAS_BACKEND": "torch"}, [
    Chained("test_tensorflow2_keras_mnist_fit_with_callbacks[torch]", "examples/tensorflow2_keras_mnist.py",
            _KERAS_ARGS, ("torch", "keras", "sklearn")),
    Chained("test_pytorch_mnist_one_epoch_fp16_allreduce", "examples/pytorch_mnist.py",
            ("--epochs", "1", "--fp16-allreduce", "--log-interval", "5"), ("torch", "sklearn")),
    Chained("test_pytorch_synthetic_benchmark_tiny", "examples/pytorch_synthetic_benchmark.py", _SYNTHETIC_TINY,
            ("torch",)),
    Chained("test_synthetic_benchmark_use_adasum_tiny", "examples/pytorch_synthetic_benchmark.py",
            ("--use-adasum", *_SYNTHETIC_TINY), ("torch",)),
])
chained = pytest.mark.timeout(CHAIN_TIMEOUT_S + 60)


def test_numpy_logistic_regression_one_epoch():
    out = _hora_run_2("examples/numpy_logistic_regression.py", "--epochs", "1", "--samples", "4000")
    lines = _rank0_lines(out)
    epoch = [line for line in lines if line.startswith("epoch 1:")]
    assert epoch, out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", epoch[0]).group(1))
    assert accuracy > 0.2, epoch[0]  # 10 classes: chance is 0.1
    assert "weights identical on all 2 workers: True" in lines, out


def _test_set_accuracy(out: str, lines: list[str]) -> float:
    tests = [re.search(r"Test set: Average loss: ([0-9.]+), Accuracy: ([0-9.]+)%", line) for line in lines]
    tests = [m for m in tests if m]
    assert len(tests) == 1, out
    return float(tests[0].group(2))


def _check_benchmark_lines(out: str, model: str, unit: str) -> None:
    """Horovod's synthetic-benchmark printout, on 2 workers with batch 2."""
    lines = _rank0_lines(out)
    assert f"Model: {model}" in lines and "Batch size: 2" in lines and f"Number of {unit}s: 2" in lines, out
    assert any(re.fullmatch(rf"Iter #0: [0-9.]+ img/sec per {unit}", line) for line in lines), out
    assert any(re.fullmatch(rf"Img/sec per {unit}: [0-9.]+ \+-[0-9.]+", line) for line in lines), out
    assert any(re.fullmatch(rf"Total img/sec on 2 {unit}\(s\): [0-9.]+ \+-[0-9.]+", line) for line in lines), out


@chained
def test_pytorch_mnist_one_epoch_fp16_allreduce(request):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out = TORCH_CHAIN.output(request)  # examples/pytorch_mnist.py --epochs 1 --fp16-allreduce --log-interval 5
    lines = _rank0_lines(out)
    assert any(line.startswith("Train Epoch: 1 [0/") and "Loss:" in line for line in lines), out
    assert _test_set_accuracy(out, lines) > 20.0  # 10 digits: chance is 10%
    assert re.search(r"Final test accuracy: [0-9.]+% after 1 epoch\(s\)", out), out
    # Only rank 0 prints progress.
    assert not [line for line in out.splitlines() if line.startswith("[1]<stdout>:") and "Test set" in line]


@chained
def test_pytorch_synthetic_benchmark_tiny(request):
    torch = pytest.importorskip("torch")
    out = TORCH_CHAIN.output(request)  # examples/pytorch_synthetic_benchmark.py, 1 batch at 32x32
    unit = "GPU" if torch.cuda.is_available() else "CPU"  # the example trains on a GPU where there is one
    _check_benchmark_lines(out, "resnet18", unit)


@chained
@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_tensorflow2_keras_mnist_fit_with_callbacks(backend, request):
    pytest.importorskip("sklearn")
    pytest.importorskip("keras")
    pytest.importorskip(backend)
    # examples/tensorflow2_keras_mnist.py --epochs 2 --warmup-epochs 1 --fp16-allreduce, KERAS_BACKEND=backend
    out = (TF_CHAIN if backend == "tensorflow" else TORCH_CHAIN).output(request)
    lines = _rank0_lines(out)
    assert any(f"{backend} backend" in line for line in lines), out
    assert any(re.match(r"Epoch 1: finished gradual learning rate warmup to 0\.002", line) for line in lines), out
    assert _test_set_accuracy(out, lines) > 20.0  # 10 digits: chance is 10%
    assert "weights identical on all 2 workers: True" in lines, out
    assert any(re.match(r"Final test accuracy: [0-9.]+% after 2 epoch\(s\)", line) for line in lines), out
    # Keras progress is printed on rank 0 only.
    assert not [line for line in out.splitlines() if line.startswith("[1]<stdout>:") and "Epoch" in line], out


@chained
@pytest.mark.parametrize("workers", [2, 3])
def test_tensorflow1_monitored_training_session_mnist(workers, request):
    """examples/tensorflow_mnist.py: a tf.compat.v1 graph, MonitoredTrainingSession,
    BroadcastGlobalVariablesHook and a v1 optimizer wrapped by DistributedOptimizer; each step's
    session.run evaluates the gradients' allreduces and two metric allreduces at once. At -np 2 it
    runs last in the TensorFlow chain; at -np 3 on its own."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    args = ["examples/tensorflow_mnist.py", "--epochs", "4", "--log-every", "10"]
    out = TF_CHAIN.output(request) if workers == 2 else _run(["-m", "hora", "run", "-np", "3", "python", *args]).stdout
    lines = _rank0_lines(out)
    steps = 4 * (1437 // workers // 32)
    logged = [re.fullmatch(rf"step (\d+)/{steps}: loss ([0-9.]+), accuracy ([0-9.]+)", line) for line in lines]
    logged = [m for m in logged if m]
    assert [int(m.group(1)) for m in logged] == list(range(10, steps + 1, 10)), out
    assert float(logged[-1].group(2)) < float(logged[0].group(2)), out  # the averaged loss went down
    final = re.search(rf"Final test accuracy: ([0-9.]+)% after 4 epoch\(s\) \({steps} steps\)", out)
    assert final and float(final.group(1)) >= 90.0, out  # the Keras example's level; chance is 10%
    assert f"on {workers} worker(s)" in out, out


@chained
def test_tensorflow2_mnist_gradient_tape(request):
    """60 steps shared by the 2 workers, 30 each: the averaged gradients take the test accuracy well
    above chance (10%) by then (about 90%; 97% after 60 steps each)."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    out = TF_CHAIN.output(request)  # examples/tensorflow2_mnist.py --steps 60 --log-interval 10
    lines = _rank0_lines(out)
    steps = [line for line in lines if re.fullmatch(r"Step #\d+\tLoss: [0-9.]+", line)]
    assert [line.split("\t")[0] for line in steps] == ["Step #0", "Step #10", "Step #20"], out
    final = re.search(r"Final test accuracy: ([0-9.]+)% after 30 step\(s\) per worker", out)
    assert final and float(final.group(1)) > 20.0, out


@chained
def test_tensorflow2_synthetic_benchmark_tiny(request):
    tf = pytest.importorskip("tensorflow")
    out = TF_CHAIN.output(request)  # examples/tensorflow2_synthetic_benchmark.py, 1 batch at 32x32
    unit = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"  # the example trains on a GPU where there is one
    _check_benchmark_lines(out, "ResNet18", unit)


@chained
def test_synthetic_benchmark_use_adasum_tiny(request):
    torch = pytest.importorskip("torch")
    out = TORCH_CHAIN.output(request)  # examples/pytorch_synthetic_benchmark.py --use-adasum, 1 batch at 32x32
    _check_benchmark_lines(out, "resnet18", "GPU" if torch.cuda.is_available() else "CPU")


def test_torch_vs_ddp_tiny():
    pytest.importorskip("torch")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no Gloo backend")
    # --shared-workers: every contender takes its turn in one pair of workers (torch imported twice, not five times).
    out = _run(["benchmarks/torch_vs_ddp.py", "--rounds", "1", "--warmup", "0", "--iters", "2",
                "--batch-size", "2", "--image-size", "32", "--shared-workers"]).stdout
    ratios = dict(re.findall(r"^ratio (\S+): ([0-9.]+)$", out, re.MULTILINE))
    assert set(ratios) == {"hora/ddp", "hora/single", "ddp/single"}, out
    assert all(float(value) > 0 for value in ratios.values()), out
    rows = re.findall(r"^(hora DistributedOptimizer|torch DDP \(gloo\)|1 process, no distribution)\s+(\d+)\s+([0-9.]+)",
                      out, re.MULTILINE)
    assert [(label, int(workers)) for label, workers, _ in rows] == [
        ("hora DistributedOptimizer", 2), ("torch DDP (gloo)", 2), ("1 process, no distribution", 1)], out
    # Same initial weights (broadcast from rank 0), same data, same averaged gradients: after the
    # same steps hora and DDP reach the same loss.
    losses = dict(re.findall(r"round 1/1: (hora|ddp)\s.*final loss ([0-9.]+)", out))
    assert float(losses["hora"]) == pytest.approx(float(losses["ddp"]), abs=2e-3), out
