"""Which libnccl and which CUDA runtime hora loads, on the machines users have, and what ``hora check`` says.

NCCL: ``HORA_NCCL_LIBRARY``, then the nvidia-nccl-cu13/-cu12 wheel, then an NCCL that PyTorch or CuPy
already loaded into the process, then the system's. The CUDA runtime: ``HORA_CUDART_LIBRARY``, then one
already loaded, then the wheels' (CUDA 13's ``nvidia/cu13/lib``, CUDA 12's ``nvidia/cuda_runtime/lib``),
the CUDA major of NCCL's wheel first (else the driver's), then the system's.

There is no GPU or NCCL here, so C stand-ins play each library: every copy answers its version call
with its own number, which tells which one was loaded. They are laid out as wheel trees (the file
lists of the real wheels, read with ``unzip -l``), preloaded, or put on ``LD_LIBRARY_PATH``. Each case
runs in a fresh interpreter: what is mapped into a process and hora's cached search are process state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from job_env import clean_env

import hora

pytestmark = pytest.mark.timeout(60)

_STAND_IN = r"""
#ifdef NCCL
int ncclGetVersion(int *v) { *v = NCCL; return 0; }
const char *ncclGetErrorString(int r) { return "stand-in"; }
#endif
#ifdef CUDART
int cudaRuntimeGetVersion(int *v) { *v = CUDART; return 0; }
int cudaGetDeviceCount(int *n) { *n = 0; return 100; }
const char *cudaGetErrorString(int e) { return "no CUDA-capable device is detected"; }
#endif
#ifdef DRIVER
int cuDriverGetVersion(int *v) { *v = DRIVER; return 0; }
#endif
"""

# Each stand-in's version code: which library answered.
NCCL_CODES = {"override": 29901, "wheel": 29902, "loaded": 29903, "system": 29904}
CUDART_CODES = {"override": 12010, "loaded": 12050, "wheel12": 12080, "wheel13": 13000, "system13": 13020}
DRIVER_CODES = {"driver12": 12080, "driver13": 13000}
# Where the real wheels put their libraries (nvidia-nccl-cu12/-cu13 2.27.7 to 2.32.3 alike;
# nvidia-cuda-runtime-cu12 12.9; nvidia-cuda-runtime 13.0 and 13.5, CUDA 13's runtime wheel).
NCCL_IN_WHEEL = "nvidia/nccl/lib/libnccl.so.2"
CUDART_IN_WHEEL = {12: "nvidia/cuda_runtime/lib/libcudart.so.12", 13: "nvidia/cu13/lib/libcudart.so.13"}
SRC = str(Path(hora.__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Every stand-in, compiled once (in parallel): name -> library file."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here to build the stand-in libraries (install gcc)")
    folder = tmp_path_factory.mktemp("stand_ins")
    source = folder / "stand_in.c"
    source.write_text(_STAND_IN)
    wanted = {**{f"nccl_{k}": f"-DNCCL={v}" for k, v in NCCL_CODES.items()},
              **{f"cudart_{k}": f"-DCUDART={v}" for k, v in CUDART_CODES.items()},
              **{k: f"-DDRIVER={v}" for k, v in DRIVER_CODES.items()}}
    jobs = {name: subprocess.Popen([compiler, "-shared", "-fPIC", flag, "-o", str(folder / f"{name}.so"), str(source)],
                                   stderr=subprocess.PIPE) for name, flag in wanted.items()}
    for name, job in jobs.items():
        _, err = job.communicate(timeout=50)
        assert job.returncode == 0, f"{name}: {err.decode()}"
    return {name: folder / f"{name}.so" for name in wanted}


def _place(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def _site(root: Path, built: dict[str, Path], nccl_wheels: tuple[int, ...] = (13,),
          runtimes: tuple[int, ...] = (12, 13), nccl_file_of: int | None = None) -> Path:
    """A site-packages directory holding NVIDIA wheels as pip lays them out: the NCCL wheels named by
    ``nccl_wheels`` (each with its dist-info; both share ``nvidia/nccl/lib/libnccl.so.2``, whose size is
    that of ``nccl_file_of``'s RECORD) and the CUDA runtime wheels of ``runtimes``."""
    root.mkdir(parents=True)
    if nccl_wheels:
        lib = _place(built["nccl_wheel"], root / NCCL_IN_WHEEL)
        for major in nccl_wheels:
            size = lib.stat().st_size + (0 if nccl_file_of in (None, major) else 1000)
            info = root / f"nvidia_nccl_cu{major}-2.32.3.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu{major}\nVersion: 2.32.3\n")
            (info / "RECORD").write_text(f"{NCCL_IN_WHEEL},sha256=x,{size}\n")
    for major in runtimes:
        _place(built[f"cudart_wheel{major}"], root / CUDART_IN_WHEEL[major])
    return root


_PREAMBLE = """
import ctypes, importlib.machinery, importlib.util, json, sys
sites = {sites!r}
sys.path[:0] = sites
# The nvidia namespace package is exactly these trees, whatever NVIDIA wheels this interpreter has.
spec = importlib.machinery.ModuleSpec("nvidia", None, is_package=True)
spec.submodule_search_locations = [site + "/nvidia" for site in sites]
sys.modules["nvidia"] = importlib.util.module_from_spec(spec)
for path in {preload!r}:
    ctypes.CDLL(path)
"""

_ASK = """
from hora.nccl import cudart, library
lib, where = cudart._load()
code = ctypes.c_int()
if lib is not None:
    lib.cudaRuntimeGetVersion(ctypes.byref(code))
print(json.dumps({"nccl": library.nccl_version(), "nccl_path": library.library_path(),
                  "cudart": code.value, "cudart_path": where if lib is not None else None}))
"""

_CHECK = """
from hora.cli import main
sys.exit(main(["check"]))
"""


def _run(script: str, sites: tuple[Path, ...] = (), preload: tuple[Path, ...] = (), ld_path: tuple[Path, ...] = (),
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = _PREAMBLE.format(sites=[str(s) for s in sites], preload=[str(p) for p in preload]) + textwrap.dedent(script)
    environ = clean_env({"PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])),
                         "LD_LIBRARY_PATH": os.pathsep.join(str(p) for p in ld_path), **(env or {})})
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done


def _ask(**kwargs: Any) -> dict[str, Any]:
    return json.loads(_run(_ASK, **kwargs).stdout.strip().splitlines()[-1])


def _system(root: Path, built: dict[str, Path], *names: str) -> Path:
    """A directory the dynamic loader searches (through LD_LIBRARY_PATH) holding the named stand-ins."""
    files = {"nccl_system": "libnccl.so.2", "cudart_system13": "libcudart.so.13",
             "driver12": "libcuda.so.1", "driver13": "libcuda.so.1"}
    for name in names:
        _place(built[name], root / files[name])
    return root


def _loaded(root: Path, built: dict[str, Path], name: str, file: str) -> Path:
    """A library some framework loaded from a directory of its own (torch's, CuPy's)."""
    return _place(built[name], root / file)


# --- NCCL: the order of the four places ---------------------------------------------------------------


def test_nccl_override_beats_the_wheel(tmp_path, built):
    override = _place(built["nccl_override"], tmp_path / "site_build" / "libnccl.so.2")
    found = _ask(sites=(_site(tmp_path / "site", built),),
                 preload=(_loaded(tmp_path / "torch", built, "nccl_loaded", "libnccl.so.2"),),
                 ld_path=(_system(tmp_path / "sys", built, "nccl_system"),), env={"HORA_NCCL_LIBRARY": str(override)})
    assert found["nccl"] == NCCL_CODES["override"]
    assert found["nccl_path"] == str(override)


def test_nccl_wheel_beats_the_one_already_loaded(tmp_path, built):
    site = _site(tmp_path / "site", built)
    found = _ask(sites=(site,), preload=(_loaded(tmp_path / "torch", built, "nccl_loaded", "libnccl.so.2"),),
                 ld_path=(_system(tmp_path / "sys", built, "nccl_system"),))
    assert found["nccl"] == NCCL_CODES["wheel"]
    assert found["nccl_path"] == str(site / NCCL_IN_WHEEL)


def test_nccl_already_loaded_beats_the_system(tmp_path, built):
    """torch or CuPy loaded an NCCL of their own (libnccl.so.2.21.5, say): hora uses that one."""
    loaded = _loaded(tmp_path / "cupy", built, "nccl_loaded", "libnccl.so.2.21.5")
    found = _ask(preload=(loaded,), ld_path=(_system(tmp_path / "sys", built, "nccl_system"),))
    assert found["nccl"] == NCCL_CODES["loaded"]
    assert found["nccl_path"] == str(loaded)


def test_nccl_from_the_system_is_reported_by_its_file(tmp_path, built):
    system = _system(tmp_path / "sys", built, "nccl_system")
    found = _ask(ld_path=(system,))
    assert found["nccl"] == NCCL_CODES["system"]
    assert found["nccl_path"] == str(system / "libnccl.so.2")  # the file the loader chose, not a bare name


# --- the CUDA runtime that goes with it --------------------------------------------------------------


@pytest.mark.parametrize(("nccl_wheels", "nccl_file_of", "major"), [((12,), None, 12), ((13,), None, 13),
                                                                     ((12, 13), 13, 13), ((12, 13), 12, 12)],
                         ids=["cu12", "cu13", "both-file-is-cu13", "both-file-is-cu12"])
def test_cudart_matches_the_cuda_major_of_nccls_wheel(tmp_path, built, nccl_wheels, nccl_file_of, major):
    """torch on CUDA 13 installs nvidia-nccl-cu13 and CUDA 13's runtime; a driver new enough for both
    majors must not pull in the other. With both NCCL wheels installed (they share one file), the
    file's size in each wheel's RECORD says whose it is."""
    site = _site(tmp_path / "site", built, nccl_wheels=nccl_wheels, nccl_file_of=nccl_file_of)
    found = _ask(sites=(site,), ld_path=(_system(tmp_path / "sys", built, "driver13", "cudart_system13"),))
    assert found["nccl"] == NCCL_CODES["wheel"]
    assert found["cudart_path"] == str(site / CUDART_IN_WHEEL[major])
    assert found["cudart"] == CUDART_CODES[f"wheel{major}"]


@pytest.mark.parametrize("major", [12, 13])
def test_cudart_follows_the_driver_when_nccls_cuda_major_is_unknown(tmp_path, built, major):
    """A system NCCL says nothing of its CUDA major: the driver's CUDA version (cuDriverGetVersion) decides."""
    site = _site(tmp_path / "site", built, nccl_wheels=())
    found = _ask(sites=(site,), ld_path=(_system(tmp_path / "sys", built, "nccl_system", f"driver{major}"),))
    assert found["nccl"] == NCCL_CODES["system"]
    assert found["cudart_path"] == str(site / CUDART_IN_WHEEL[major])


def test_cudart_override_beats_loaded_and_loaded_beats_the_wheels(tmp_path, built):
    site = _site(tmp_path / "site", built)
    loaded = _loaded(tmp_path / "torch", built, "cudart_loaded", "libcudart.so.12.5.82")
    override = _place(built["cudart_override"], tmp_path / "site_build" / "libcudart.so")
    with_override = _ask(sites=(site,), preload=(loaded,), env={"HORA_CUDART_LIBRARY": str(override)})
    assert (with_override["cudart"], with_override["cudart_path"]) == (CUDART_CODES["override"], str(override))
    without = _ask(sites=(site,), preload=(loaded,))
    assert (without["cudart"], without["cudart_path"]) == (CUDART_CODES["loaded"], str(loaded))


def test_cudart_from_the_system_after_the_wheels(tmp_path, built):
    system = _system(tmp_path / "sys", built, "cudart_system13", "driver13")
    found = _ask(sites=(_site(tmp_path / "site", built, runtimes=()),), ld_path=(system,))
    assert (found["cudart"], found["cudart_path"]) == (CUDART_CODES["system13"], str(system / "libcudart.so.13"))


# --- hora check ----------------------------------------------------------------------------------------


def test_check_names_each_library_file_its_version_and_what_was_passed_over(tmp_path, built):
    site = _site(tmp_path / "site", built)
    out = _run(_CHECK, sites=(site,), ld_path=(_system(tmp_path / "sys", built, "driver13"),),
               env={"HORA_NCCL_LIBRARY": str(tmp_path / "gone" / "libnccl.so.2")}).stdout
    assert f"NCCL library: {site / NCCL_IN_WHEEL}, version 2.99.2 (nvidia-nccl-cu13 wheel)" in out
    assert f"passed over {tmp_path / 'gone' / 'libnccl.so.2'} (HORA_NCCL_LIBRARY): " in out  # and why
    assert f"CUDA runtime library: {site / CUDART_IN_WHEEL[13]}, version 13.0 (nvidia-cuda-runtime wheel" in out
    assert "CUDA 13 to match NCCL's nvidia-nccl-cu13 wheel" in out
    assert "no CUDA-capable device is detected" in out


def test_check_lists_every_place_tried_when_no_nccl_loads(tmp_path, built):
    probe = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libnccl.so.2')"],
                           env=clean_env({"LD_LIBRARY_PATH": ""}), capture_output=True, timeout=30)
    if probe.returncode == 0:
        pytest.skip("this machine has a system libnccl.so.2")
    gone = tmp_path / "gone" / "libnccl.so.2"
    out = _run(_CHECK, sites=(_site(tmp_path / "site", built, nccl_wheels=()),),
               env={"HORA_NCCL_LIBRARY": str(gone)}).stdout
    section = out[out.index("NCCL library:"):]
    tried = [line.strip() for line in section.splitlines()[1:5]]
    assert "NCCL library: none found" in section
    assert tried[0].startswith(f"{gone} (HORA_NCCL_LIBRARY): ")
    assert tried[1].startswith("nvidia-nccl-cu13/-cu12 wheel: not installed")
    assert tried[2].startswith("loaded in this process: no libnccl.so")
    assert tried[3].startswith("libnccl.so.2 (system loader): ")
