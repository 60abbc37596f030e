"""Every optional extra works alone: ``pip install "hora[X]"`` into an environment with nothing else is
enough to run X's smoke example (smoke_*.py in this folder).

The rest of the suite runs in one environment that holds every framework at once, where an extra
that forgot a dependency still works because another extra brought it. That is how ``hora[spark]``
shipped without pandas: training ran, but ``transform`` (Spark's ``mapInArrow``, which refuses to run
without pandas) failed for anyone who installed the extra as documented.

So each test here builds a fresh venv with uv (it hard-links packages from its cache, so once the
cache is warm a venv costs seconds), installs hora's wheel (built once per module from this
checkout: a real install, not the editable one) with exactly one extra, checks that the other
frameworks are absent (else the check would prove nothing), and runs the smoke, asserting on the
values it computed, not only on its exit status.

The venv is a fixture, so ``--durations=0`` reports the install (setup) and the smoke (call) apart.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

#: The frameworks an extra may bring; each venv must hold only those its extra declares (or their
#: own dependencies bring), so a smoke cannot pass on a package another extra would have installed.
#: ``nvidia`` is the namespace of NVIDIA's wheels: only the cuda extra (or a CUDA build of torch) has it.
FRAMEWORKS = ("torch", "tensorflow", "tf_keras", "keras", "jax", "ray", "pyspark", "lightning", "mpi4py",
              "matplotlib", "sklearn", "nvidia")

#: Extras that get no test here, and why; every other extra in pyproject.toml must have one.
NOT_SMOKED = {
    "tensorflow": "the GPU package of tensorflow-cpu's smoke (the same hora.tensorflow, a larger download); "
                  "tf-keras installs it too",
    "mxnet": "needs numpy<1.24; tests/hora_mxnet runs MXNet in a venv of its own (from its own requirement "
             "list, not from the extra)",
    "examples": "not a feature: the examples' own data loader (scikit-learn)",
    "test": "the test suite's own tools",
    "docs": "the documentation site's tools",
}

#: The weights after one averaged SGD step, and after two (smoke_torch.py's docstring derives them).
ONE_STEP = [-0.125, -0.875, 0.375]
TWO_STEPS = [0.1875, -0.5625, 0.6875]
TORCH_FALLBACK_VERSION = "2.13.0"
INSTALL_TIMEOUT_S = 600
SMOKE_TIMEOUT_S = 240


# ---- the environments -------------------------------------------------------------------------------

def _uv() -> str | None:
    """uv on PATH, or the one the ``uv`` package on this Python ships (requirements/test.txt)."""
    found = shutil.which("uv")
    if found:
        return found
    try:
        from uv import find_uv_bin  # type: ignore[import-not-found]
    except ImportError:
        return None
    return find_uv_bin()


UV = _uv()


def _clean_env(extra: Mapping[str, str] | None = None, path_first: Path | None = None) -> dict[str, str]:
    """This process's environment without what would point a child at another Python or hora job:
    hora's variables (a rank, a rendezvous), PYTHONPATH and the active venv."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_"))
           and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    if path_first is not None:
        env["PATH"] = os.pathsep.join([str(path_first), env.get("PATH", "")])
    env.update(extra or {})
    return env


def _run(argv: Sequence[str | Path], timeout: float, env: Mapping[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Output captured for the assertion messages; the time-out keeps a hung child from using up the
    test's whole limit without saying which command hung."""
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                          env=dict(env) if env is not None else _clean_env(), cwd=cwd)


def _tail(done: subprocess.CompletedProcess[str], chars: int = 6000) -> str:
    return f"exit {done.returncode}\n--- stdout ---\n{done.stdout[-chars:]}\n--- stderr ---\n{done.stderr[-chars:]}"


def uv_offline_first(args: Sequence[str | Path], timeout: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``uv ARGS``, from uv's cache alone when it holds everything, else with the network.

    uv revalidates index pages and sdists by their HTTP caching headers; behind a proxy that strips
    them, every install re-downloads and rebuilds each sdist (pyspark: 400 MB, a minute of building
    and another GB in the cache, per venv). ``--offline`` takes what the cache has and fails fast
    when something is missing; only then does the network get asked.
    """
    offline = _run([UV, *args, "--offline"], timeout=timeout, cwd=cwd)
    if offline.returncode == 0:
        return offline
    return _run([UV, *args], timeout=timeout, cwd=cwd)


def pip_find_links() -> list[str]:
    """The find-links locations pip is configured with (its config files and PIP_FIND_LINKS): where a
    machine keeps wheels it cannot or should not download, such as torch's CPU build. uv does not
    read pip's configuration, so these are handed to it explicitly."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        listed = _run([sys.executable, "-m", "pip", "config", "list"], timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            found += value.strip().strip("'\"").split()
    return list(dict.fromkeys(found))


def torch_requirement(find_links: Sequence[str]) -> tuple[str, bool]:
    """An exact torch pin and whether it is a local CPU build.

    Any torch requirement left open resolves to PyPI's Linux wheel, the CUDA build (several GB with
    its nvidia-* wheels). A CPU wheel in a find-links directory is pinned by its full version
    (``2.13.0+cpu``), the only spelling that selects it; without one, the known-good release is
    pinned and fetched from the index.
    """
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    versions: list[Version] = []
    for location in find_links:
        directory = Path(location.removeprefix("file://"))
        if not directory.is_dir():
            continue
        for wheel in directory.glob("torch-*.whl"):
            try:
                _, version, _, tags = parse_wheel_filename(wheel.name)
            except ValueError:
                continue
            if version.local == "cpu" and any(t.interpreter == tag for t in tags):
                versions.append(version)
    if versions:
        return f"torch=={max(versions)}", True
    return f"torch=={TORCH_FALLBACK_VERSION}", False


@dataclass(frozen=True)
class Venv:
    """A venv holding hora and one extra; ``cpu_torch``: its torch is the pinned CPU build."""

    root: Path
    env: dict[str, str]
    cpu_torch: bool = False

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def run(self, argv: Sequence[str | Path], cwd: Path, timeout: float = SMOKE_TIMEOUT_S,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` in this venv (its bin first on PATH); the command must succeed."""
        done = _run(argv, timeout=timeout, env={**self.env, **(env or {})}, cwd=cwd)
        assert done.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{_tail(done)}"
        return done

    def hora_run(self, script: str, cwd: Path, options: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 ) -> subprocess.CompletedProcess[str]:
        """``hora run -np 2 [options] python smoke`` with this venv's hora and Python."""
        return self.run([self.bin / "hora", "run", "-np", "2", *options, self.python, HERE / script], cwd, env=env)

    def python_script(self, script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return self.run([self.python, HERE / script], cwd)


# ---- what each extra must do ------------------------------------------------------------------------

def smoke_records(output: str) -> list[dict[str, Any]]:
    """The JSON each smoke printed after ``SMOKE ``, behind whatever prefix the launcher added and
    before anything another rank's output may have appended to the line."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(line.split("SMOKE ", 1)[1])[0] for line in output.splitlines() if "SMOKE " in line]


def by_rank(output: str, size: int = 2) -> dict[int, dict[str, Any]]:
    """One record per rank of a ``size``-rank job, keyed by rank; every rank must have reported."""
    records = {r["rank"]: r for r in smoke_records(output) if "rank" in r}
    assert sorted(records) == list(range(size)), f"expected a SMOKE line from each of {size} ranks:\n{output[-4000:]}"
    assert all(r["size"] == size for r in records.values()), records
    return records


def check_torch(venv: Venv, work: Path) -> None:
    ranks = by_rank(venv.hora_run("smoke_torch.py", work).stdout)
    for record in ranks.values():
        assert record["sum"] == [3.0, 20.0]
        assert record["grad"] == pytest.approx([6.25] * 3)
        assert record["weights"] == pytest.approx(ONE_STEP)
        if venv.cpu_torch:
            assert record["cuda_build"] is None, "the pinned CPU torch was not the one installed"


def check_tensorflow(venv: Venv, work: Path) -> None:
    ranks = by_rank(venv.hora_run("smoke_tensorflow.py", work).stdout)
    for record in ranks.values():
        assert record["sum"] == [3.0, 20.0]
        assert record["grad"] == pytest.approx([6.25] * 3)
        assert record["weights"] == pytest.approx(ONE_STEP)


def check_tf_keras(venv: Venv, work: Path) -> None:
    ranks = by_rank(venv.hora_run("smoke_tf_keras.py", work).stdout)
    for rank, record in ranks.items():
        assert record["model_module"].startswith("tf_keras."), record  # Keras 2, not Keras 3
        assert record["optimizer_is_tf_keras"] is True
        assert record["weights"] == pytest.approx(ONE_STEP)
        assert record["loss"] == pytest.approx([1.5625 * (rank + 1) ** 2])  # each rank's own batch


def check_mpi(venv: Venv, work: Path) -> None:
    mpi_env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    ranks = by_rank(venv.hora_run("smoke_mpi.py", work, options=["--mpi"], env=mpi_env).stdout)
    for record in ranks.values():
        assert record["mpi_enabled"] is True, "the ranks did not reduce through mpi4py"
        assert record["sum"] == [3.0, 20.0]
        assert record["average"] == pytest.approx([0.0, 1.5, 3.0, 4.5])


def check_ray(venv: Venv, work: Path) -> None:
    ranks = by_rank(venv.python_script("smoke_ray.py", work).stdout)
    for record in ranks.values():
        assert record["sum"] == [3.0, 20.0]
        assert len(set(record["pids"])) == 2 and record["driver_pid"] not in record["pids"], record


def check_spark(venv: Venv, work: Path) -> None:
    output = venv.python_script("smoke_spark.py", work).stdout
    for record in by_rank(output).values():
        assert record["sum"] == [3.0, 20.0]
    transforms = [r["transform"] for r in smoke_records(output) if "transform" in r]
    assert transforms == [[[float(i), 2.0 * i] for i in range(1, 7)]], output[-4000:]


def check_lightning(venv: Venv, work: Path) -> None:
    ranks = by_rank(venv.hora_run("smoke_lightning.py", work).stdout)
    for record in ranks.values():
        assert record["world_size"] == 2 and record["global_step"] == 2
        assert record["weights"] == pytest.approx(TWO_STEPS)


def check_jax(venv: Venv, work: Path) -> None:
    ranks = by_rank(venv.hora_run("smoke_jax.py", work).stdout)
    for record in ranks.values():
        assert record["is_jax_array"] is True
        assert record["sum"] == [3.0, 20.0]
        assert record["update"] == pytest.approx([-0.625] * 3)
        assert record["weights"] == pytest.approx(ONE_STEP)


def check_plot(venv: Venv, work: Path) -> None:
    trace, png = work / "timeline.json", work / "timeline.png"
    ranks = by_rank(venv.hora_run("smoke_plot.py", work, env={"HOROVOD_TIMELINE": str(trace)}).stdout)
    assert all(r["sums"] == [[2.0 * s + 3] * 3 for s in range(4)] for r in ranks.values()), ranks
    report = venv.run([venv.bin / "hora", "timeline", trace, "--plot", png], work).stdout
    assert re.search(r"^timeline: 3 tensors, [1-9]\d* negotiations", report, re.M), report
    assert f"plot written to {png}" in report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


#: Horovod's autotune log columns, and hora's first joint settings (cycle ms, fusion MiB) before the
#: Gaussian process proposes any (hora.engine.autotune.START_POINTS).
AUTOTUNE_HEADER = ["hierarchical_allreduce", "hierarchical_allgather", "cache_enabled", "cycle_time_ms",
                   "tensor_fusion_threshold", "score"]
AUTOTUNE_START = [(1.0, 64.0), (5.0, 4.0), (10.0, 128.0), (2.5, 16.0)]
AUTOTUNE_SAMPLES = 5


def check_autotune(venv: Venv, work: Path) -> None:
    log = work / "autotune.csv"
    done = venv.hora_run("smoke_autotune.py", work, options=[
        "--autotune", "--autotune-log-file", str(log), "--autotune-warmup-samples", "1",
        "--autotune-steps-per-sample", "2", "--autotune-bayes-opt-max-samples", str(AUTOTUNE_SAMPLES)])
    ranks = by_rank(done.stdout)
    assert "autotune: done; best setting" in done.stderr, _tail(done)
    for record in ranks.values():
        assert record["tuning"] is True and record["still_active"] is False, record
        assert record["wrong"] == 0
    assert ranks[0]["fusion_mb"] == ranks[1]["fusion_mb"] and ranks[0]["cycle_ms"] == ranks[1]["cycle_ms"]
    with open(log, newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == AUTOTUNE_HEADER
    trials = [[float(v) for v in row] for row in rows[1:]]
    assert len(trials) == AUTOTUNE_SAMPLES + 2, rows  # the joint samples, the cache switched off, the best
    assert [(t[3], t[4]) for t in trials[:4]] == AUTOTUNE_START
    proposed = (trials[4][3], trials[4][4])
    assert proposed not in AUTOTUNE_START, "the fifth setting should come from the Gaussian process"
    assert trials[-1] == max(trials[:-1], key=lambda t: t[5]), rows  # the best, logged last
    assert ranks[0]["fusion_mb"] == pytest.approx(trials[-1][4], rel=1e-3, abs=1e-3)
    assert ranks[0]["cycle_ms"] == pytest.approx(trials[-1][3], rel=1e-3)


def check_yaml(venv: Venv, work: Path) -> None:
    ranks = by_rank(venv.run([venv.bin / "hora", "run", "--config-file", HERE / "cfg_smoke.yaml", "-np", "2",
                              venv.python, HERE / "smoke_yaml.py"], work).stdout)
    for record in ranks.values():
        assert record["sum"] == [3.0, 20.0]
        assert record["fusion_threshold"] == 32 * 2**20
        assert record["cycle_time_ms"] == pytest.approx(7.5)
        assert record["cache_capacity"] == 64 and record["timeline_mark_cycles"] is True


def check_cuda(venv: Venv, work: Path) -> None:
    site = str(venv.root)
    report = venv.run([venv.bin / "hora", "check"], work).stdout
    found = re.search(r"NCCL \(GPU tensors\): NCCL (\d+\.\d+\.\d+), nccl_built\(\) == (\d+); "
                      r"usable: (yes|no) \((.*)\)$", report, re.M)
    assert found, f"hora check did not report an NCCL library:\n{report}"
    version, code, usable, why = found.groups()
    assert int(code) > 0 and f"NCCL {version} from {site}" in why, found.group(0)
    if usable == "no":
        assert "CUDA" in why, found.group(0)  # unusable for want of a GPU or driver, not of the library

    (record,) = smoke_records(venv.python_script("smoke_cuda.py", work).stdout)
    assert record["nccl_version"] == version and record["nccl_version_code"] == int(code)
    assert record["nccl_library"].startswith(site) and "/nvidia/nccl/" in record["nccl_library"], record
    assert record["cudart_loads"] is True, "the nvidia-cuda-runtime wheel's libcudart did not load"
    assert record["unique_id_bytes"] == 128


# ---- the extras -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Extra:
    """One extra: what it must make importable, what it may bring besides, what it needs from the
    system, and its check."""

    name: str
    brings: tuple[str, ...]
    check: Callable[[Venv, Path], None]
    allows: tuple[str, ...] = ()
    needs_torch: bool = False
    needs_program: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)


EXTRAS = (
    Extra("torch", ("torch",), check_torch, needs_torch=True),
    Extra("tensorflow-cpu", ("tensorflow", "keras"), check_tensorflow),
    # tf-keras requires the `tensorflow` package itself (not tensorflow-cpu), which brings Keras 3.
    Extra("tf-keras", ("tf_keras", "tensorflow", "keras"), check_tf_keras, env={"TF_USE_LEGACY_KERAS": "1"}),
    Extra("mpi", ("mpi4py",), check_mpi, needs_program="mpirun"),
    Extra("ray", ("ray",), check_ray),
    Extra("spark", ("pyspark", "pyarrow", "pandas"), check_spark, needs_program="java"),
    Extra("lightning", ("lightning", "torch"), check_lightning, needs_torch=True),
    Extra("jax", ("jax", "jaxlib", "optax"), check_jax, env={"JAX_PLATFORMS": "cpu"}),
    Extra("plot", ("matplotlib",), check_plot),
    Extra("autotune", ("sklearn", "scipy"), check_autotune),
    Extra("yaml", ("yaml",), check_yaml),
    Extra("cuda", ("nvidia.nccl", "nvidia.cuda_runtime"), check_cuda, allows=("nvidia",)),
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hora's wheel, built once from a copy of this checkout's project files: the build leaves nothing
    (build/, egg-info) in the checkout, which others may be building from at the same time."""
    tmp = tmp_path_factory.mktemp("hora-wheel")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    built = uv_offline_first(["build", "--wheel", "--out-dir", tmp / "dist", source], timeout=600, cwd=tmp)
    assert built.returncode == 0, f"uv build failed:\n{_tail(built)}"
    (found,) = (tmp / "dist").glob("hora-*.whl")
    return found


@pytest.fixture(scope="module")
def torch_pin() -> tuple[str, list[str], bool]:
    """The exact torch requirement, the find-links locations to resolve it from, and whether it is
    the CPU build."""
    links = pip_find_links()
    requirement, cpu = torch_requirement(links)
    return requirement, links, cpu


def _present(python: Path, modules: Sequence[str]) -> dict[str, bool]:
    """Which of ``modules`` the venv's Python can find (without importing them)."""
    probe = ("import importlib.util, json, sys\n"
             "def found(name):\n"
             "    try:\n"
             "        return importlib.util.find_spec(name) is not None\n"
             "    except ModuleNotFoundError:\n"
             "        return False\n"
             "print(json.dumps({m: found(m) for m in sys.argv[1:]}))\n")
    done = _run([python, "-c", probe, *modules], timeout=120, env=_clean_env())
    assert done.returncode == 0, _tail(done)
    return json.loads(done.stdout)


@pytest.fixture
def venv(extra: Extra, wheel: Path, torch_pin: tuple[str, list[str], bool],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    """A fresh venv with hora's wheel and ``extra`` alone (plus the torch pin where it brings torch)."""
    if extra.needs_program and not shutil.which(extra.needs_program):
        pytest.skip(f"the {extra.name} smoke needs {extra.needs_program} on PATH, which is not installed")
    root = tmp_path_factory.mktemp(f"venv-{extra.name}") / "venv"
    made = _run([UV, "venv", "--python", sys.executable, root], timeout=120, cwd=root.parent)
    assert made.returncode == 0, f"uv venv failed:\n{_tail(made)}"
    requirements = [f"hora[{extra.name}] @ {wheel.as_uri()}"]
    options: list[str] = []
    if extra.needs_torch:
        requirement, links, _ = torch_pin
        requirements.append(requirement)
        for link in links:
            options += ["--find-links", link]
    installed = uv_offline_first(["pip", "install", "--python", root / "bin" / "python", *options, *requirements],
                                 timeout=INSTALL_TIMEOUT_S, cwd=root.parent)
    assert installed.returncode == 0, f"installing {' '.join(requirements)} failed:\n{_tail(installed)}"
    env = _clean_env({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                      "HORA_START_TIMEOUT": "120", **extra.env}, path_first=root / "bin")
    yield Venv(root, env, cpu_torch=extra.needs_torch and torch_pin[2])
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(UV is None, reason="needs uv (pip install uv; requirements/test.txt pins it)")
@pytest.mark.timeout(900)  # a first install downloads GBs (tensorflow, torch, pyspark); each command has its own limit
@pytest.mark.parametrize("extra", EXTRAS, ids=[e.name for e in EXTRAS])
def test_the_extra_alone_runs_its_smoke(extra: Extra, venv: Venv, tmp_path: Path) -> None:
    """The extra's packages and a real hora install are there, no other framework is, and the smoke
    computes what it should."""
    where = _present(venv.python, ["hora", *extra.brings])
    assert all(where.values()), f"hora[{extra.name}] did not install {[m for m, ok in where.items() if not ok]}"
    origin = _run([venv.python, "-c", "import hora; print(hora.__file__)"], timeout=60, env=venv.env, cwd=tmp_path)
    assert origin.stdout.strip().startswith(str(venv.root)), f"hora is not the venv's own install: {_tail(origin)}"

    allowed = set(extra.brings) | set(extra.allows)
    if extra.needs_torch and not venv.cpu_torch:
        allowed.add("nvidia")  # PyPI's Linux torch is the CUDA build, with NVIDIA's wheels
    others = [m for m in FRAMEWORKS if m not in allowed]
    stray = [m for m, ok in _present(venv.python, others).items() if ok]
    assert not stray, f"the venv of hora[{extra.name}] also holds {stray}: the smoke would not test the extra alone"

    extra.check(venv, tmp_path)


def test_every_runtime_extra_has_a_smoke() -> None:
    """A new extra gets a smoke here, or a reason in NOT_SMOKED; a renamed one cannot go untested."""
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    smoked = {e.name for e in EXTRAS}
    assert smoked <= declared, f"smoked extras not in pyproject.toml: {sorted(smoked - declared)}"
    assert declared - smoked == set(NOT_SMOKED), (
        f"extras without a smoke or a reason: {sorted(declared - smoked - set(NOT_SMOKED))}; "
        f"reasons for extras that are gone: {sorted(set(NOT_SMOKED) - (declared - smoked))}")


def test_torch_is_pinned_exactly_and_prefers_a_local_cpu_wheel(tmp_path: Path) -> None:
    """An open torch requirement would fetch the multi-GB CUDA build: the pin must be exact, and the
    CPU wheel's local version when a find-links directory has one for this Python."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    (tmp_path / f"torch-2.12.0+cpu-{tag}-{tag}-{platform}.whl").touch()
    (tmp_path / f"torch-2.13.0+cpu-{tag}-{tag}-{platform}.whl").touch()
    (tmp_path / f"torch-2.99.0-{tag}-{tag}-{platform}.whl").touch()  # not a CPU build
    (tmp_path / f"torch-2.98.0+cpu-cp39-cp39-{platform}.whl").touch()  # another Python's
    assert torch_requirement([str(tmp_path)]) == ("torch==2.13.0+cpu", True)
    assert torch_requirement([str(tmp_path / "missing"), "https://example.invalid/wheels"]) == \
        (f"torch=={TORCH_FALLBACK_VERSION}", False)
