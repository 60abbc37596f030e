"""Finding libnccl and the CUDA runtime that goes with it, and saying what was found or why nothing was.

Users' machines hold NCCL in several places, so each is tried in turn (:func:`nccl_search`):

1. ``HORA_NCCL_LIBRARY`` (a site build): the user said so;
2. the ``nvidia-nccl-cu13``/``-cu12`` wheel (``nvidia/nccl/lib/libnccl.so.2`` in both), what PyTorch's
   and CuPy's CUDA wheels install;
3. an NCCL that PyTorch or CuPy already loaded into this process (``/proc/self/maps``), so one process
   does not end up with two;
4. the system's ``libnccl.so.2`` through the dynamic loader.

NCCL links its CUDA runtime statically, so which ``libcudart`` hora loads for its own streams and copies
is a separate choice (:func:`cudart_search`): ``HORA_CUDART_LIBRARY``, then one already loaded (a
framework's: the runtime its tensors live on), then the runtime wheels, then the system's names. Among
the wheels and system names, the CUDA major of NCCL's wheel goes first, or, where NCCL's major is
unknown, the driver's: a CUDA 13 runtime does not run on a CUDA 12 driver, and a machine with torch on
CUDA 13 often has a stray CUDA 12 runtime wheel too.

Each search is made once per process and remembers every step's answer, which is what ``hora check``
prints (:func:`report_lines`): the file and version found, or every place tried and why it failed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from hora import config

NCCL_ENV = "HORA_NCCL_LIBRARY"
CUDART_ENV = "HORA_CUDART_LIBRARY"
#: nvidia-nccl-cu12 and nvidia-nccl-cu13 (2.27.7 to 2.32.3) both install this file; their dist-info says which.
NCCL_IN_WHEEL = "nccl/lib/libnccl.so.2"
#: CUDA major -> (the runtime wheel, its library under ``nvidia/``): CUDA 13's wheels moved to ``nvidia/cu13``.
CUDART_WHEELS = {13: ("nvidia-cuda-runtime", "cu13/lib/libcudart.so.13"),
                 12: ("nvidia-cuda-runtime-cu12", "cuda_runtime/lib/libcudart.so.12")}
_NCCL_MAPPED = re.compile(r"libnccl\.so(\.\d+)*")
_CUDART_MAPPED = re.compile(r"libcudart\.so(\.\d+)*")
_NCCL_DIST_INFO = re.compile(r"nvidia_nccl_cu(\d+)-[^-]+\.dist-info", re.IGNORECASE)
_INSTALL = 'install it with pip install "hora[cuda]"'
_RTLD_DI_LINKMAP = 2


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A library to try and why it is on the list, so a failure can be told apart from a choice."""

    path: str  # a file, or a name the dynamic loader resolves
    source: str  # where it came from, as hora check says it
    cuda_major: int | None = None


@dataclasses.dataclass(frozen=True)
class Step:
    """One place of a search: its candidates, or why it has none; and why they are in their order, where
    that was a choice (hora check says it of the library found)."""

    candidates: tuple[Candidate, ...]
    none_because: str = ""
    preference: str = ""


@dataclasses.dataclass(frozen=True)
class Tried:
    """One line of a search's way: a library that did not load (``failed``), or a place that had none."""

    line: str
    failed: bool


@dataclasses.dataclass(frozen=True)
class Search:
    """Where a search ended and the way there: a user whose GPU path is off needs every step's answer."""

    what: str  # "NCCL library", "CUDA runtime library"
    env: str
    lib: ctypes.CDLL | None = None
    found: Candidate | None = None
    file: str | None = None  # the file the dynamic loader mapped
    tried: tuple[Tried, ...] = ()  # the way to the library found (or all of it)
    preference: str = ""  # why the library found came before others, where that was a choice

    def outcome(self) -> tuple[ctypes.CDLL | None, str]:
        """``(library, its file)`` or ``(None, why)``: what the loaders of :mod:`hora.nccl` return."""
        if self.lib is not None:
            return self.lib, self.file or ""
        return None, self.reason()

    def reason(self) -> str:
        """Why nothing loaded, on one line (for exceptions and ``nccl_status``)."""
        return f"no {self.what} found ({_INSTALL}, or set {self.env}); tried " + "; ".join(t.line for t in self.tried)

    def describe(self, version: str | None) -> list[str]:
        """``hora check``'s lines: the file, its version and source, then what was passed over on the way."""
        if self.found is None:
            return [f"{self.what}: none found ({_INSTALL}, or set {self.env}); tried:"] + [
                f"  {t.line}" for t in self.tried]
        why = f"{self.found.source}; {self.preference}" if self.preference else self.found.source
        head = f"{self.what}: {self.file}, version {version or 'unknown'} ({why})"
        return [head] + [f"  passed over {t.line}" for t in self.tried if t.failed]


def search(what: str, env: str, steps: Iterable[Step]) -> Search:
    """Load the first candidate that loads, remembering each step's answer on the way."""
    tried: list[Tried] = []
    for step in steps:
        if not step.candidates:
            tried.append(Tried(step.none_because, failed=False))
        for candidate in step.candidates:
            try:
                lib = ctypes.CDLL(candidate.path)
            except OSError as exc:
                tried.append(Tried(f"{candidate.path} ({candidate.source}): {exc}", failed=True))
                continue
            return Search(what, env, lib, candidate, mapped_file(lib) or candidate.path, tuple(tried),
                          step.preference)
    return Search(what, env, tried=tuple(tried))


# --- the places ------------------------------------------------------------------------------------------


def override_step(knob: str, env: str) -> Step:
    """The user's own library (``HORA_NCCL_LIBRARY``/``HORA_CUDART_LIBRARY``), read through hora.config."""
    path = config.get(knob)
    if not path:
        return Step((), f"{env}: not set")
    return Step((Candidate(path, env),))


def nvidia_roots() -> list[Path]:
    """The directories of the ``nvidia`` namespace package (one per site-packages holding NVIDIA wheels)."""
    spec = importlib.util.find_spec("nvidia")
    return [Path(root) for root in (spec.submodule_search_locations or [])] if spec else []


def loaded_libraries(pattern: re.Pattern[str]) -> list[str]:
    """Files matching ``pattern`` that are mapped into this process (a framework loaded them), in map order.
    Reading ``/proc/self/maps`` imports nothing; off Linux there is nothing to read, and nothing is found."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/") and pattern.fullmatch(Path(path).name) and path not in found:
            found.append(path)
    return found


def loaded_step(pattern: re.Pattern[str], label: str,
                major_of: Callable[[Path], int | None] = lambda path: None) -> Step:
    """What a framework already loaded: using the same file keeps one copy of it in the process."""
    paths = loaded_libraries(pattern)
    return Step(tuple(Candidate(path, "loaded in this process", major_of(Path(path))) for path in paths),
                f"loaded in this process: no {label} in /proc/self/maps")


class _LinkMap(ctypes.Structure):
    """The head of glibc's ``struct link_map``: what ``dlinfo(RTLD_DI_LINKMAP)`` points at."""

    _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]


def mapped_file(lib: ctypes.CDLL) -> str | None:
    """The file the dynamic loader opened for ``lib`` (``dlinfo``): a bare name says nothing about which."""
    try:
        dlinfo = ctypes.CDLL(None).dlinfo
    except (OSError, AttributeError):  # glibc < 2.34 keeps dlinfo in libdl; other libcs may lack it
        try:
            dlinfo = ctypes.CDLL("libdl.so.2").dlinfo
        except (OSError, AttributeError):
            return None
    link = ctypes.POINTER(_LinkMap)()
    if dlinfo(ctypes.c_void_p(lib._handle), _RTLD_DI_LINKMAP, ctypes.byref(link)) != 0 or not link:
        return None
    name = link.contents.l_name
    return name.decode(errors="replace") if name else None


# --- NCCL ------------------------------------------------------------------------------------------------


def _wheel_nccl_major(lib: Path) -> int | None:
    """The CUDA major of the NCCL wheel that installed ``lib`` (``.../nvidia/nccl/lib/libnccl.so.2``), from
    the dist-info beside ``nvidia/``. Both majors' wheels install the same file, so where both are there,
    the file's size in each wheel's RECORD says whose it is."""
    if lib.parts[-4:] != ("nvidia", *NCCL_IN_WHEEL.split("/")):
        return None
    site = lib.parents[3]
    try:
        infos = {int(m.group(1)): entry for entry in site.iterdir() if (m := _NCCL_DIST_INFO.fullmatch(entry.name))}
    except OSError:
        return None
    if len(infos) == 1:
        return next(iter(infos))
    try:
        size = lib.stat().st_size
    except OSError:
        return None
    owners = [major for major, info in infos.items() if _record_size(info, f"nvidia/{NCCL_IN_WHEEL}") == size]
    return owners[0] if len(owners) == 1 else None


def _record_size(info: Path, relative: str) -> int | None:
    try:
        for line in (info / "RECORD").read_text(encoding="utf-8").splitlines():
            path, _, rest = line.partition(",")
            if path == relative:
                return int(rest.rpartition(",")[2])
    except (OSError, ValueError):
        pass
    return None


def nccl_wheel_step() -> Step:
    """The nvidia-nccl-cu13/-cu12 wheel in each site-packages, with the CUDA major its name gives."""
    found = [root / NCCL_IN_WHEEL for root in nvidia_roots() if (root / NCCL_IN_WHEEL).exists()]
    candidates = []
    for lib in found:
        major = _wheel_nccl_major(lib)
        source = f"nvidia-nccl-cu{major} wheel" if major else "nvidia-nccl wheel (CUDA major unknown)"
        candidates.append(Candidate(str(lib), source, major))
    return Step(tuple(candidates),
                f"nvidia-nccl-cu13/-cu12 wheel: not installed (no nvidia/{NCCL_IN_WHEEL} on sys.path)")


def nccl_steps() -> Iterator[Step]:
    """NCCL's places in order; a generator, so a place is looked at only when those before it failed."""
    yield override_step("nccl_library", NCCL_ENV)
    yield nccl_wheel_step()
    yield loaded_step(_NCCL_MAPPED, "libnccl.so*", _wheel_nccl_major)
    yield Step((Candidate("libnccl.so.2", "system loader"),))


@functools.lru_cache(maxsize=1)
def nccl_search() -> Search:
    """This process's NCCL: searched once, since loading is for good and the answer cannot change."""
    return search("NCCL library", NCCL_ENV, nccl_steps())


# --- the CUDA runtime ------------------------------------------------------------------------------------


def _version_code(lib: ctypes.CDLL, function: str) -> int | None:
    """A CUDA ``...GetVersion(int *)`` call's code (``13000`` for 13.0), or None where it is missing or fails."""
    code = ctypes.c_int()
    try:
        if getattr(lib, function)(ctypes.byref(code)) != 0 or code.value <= 0:
            return None
    except AttributeError:
        return None
    return code.value


def driver_cuda_major() -> int | None:
    """The newest CUDA major the installed driver runs (``cuDriverGetVersion``; needs no GPU, no cuInit)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    code = _version_code(driver, "cuDriverGetVersion")
    return None if code is None else code // 1000


def preferred_cuda_major() -> tuple[int | None, str]:
    """The CUDA major whose runtime should go with NCCL, and why (for hora check)."""
    nccl = nccl_search()
    if nccl.found is not None and nccl.found.cuda_major is not None:
        major = nccl.found.cuda_major
        return major, f"CUDA {major} to match NCCL's nvidia-nccl-cu{major} wheel"
    driver = driver_cuda_major()
    if driver is not None:
        return driver, f"CUDA {driver} to match the driver (NCCL's CUDA major unknown)"
    return None, "no CUDA major preferred (neither NCCL's nor the driver's is known)"


def _by_preference(majors: Iterable[int], preferred: int | None) -> list[int]:
    """``preferred`` first, then newest first. Nothing is known only where no driver loads, so no runtime
    could run anyway: the order then just decides which one ``hora check`` names."""
    return sorted(majors, key=lambda major: (major != preferred, -major))


def cudart_wheel_step(preferred: int | None, why: str) -> Step:
    """The runtime wheels, the preferred major's first: each major's runtime has its own file and layout."""
    candidates = []
    for major in _by_preference(CUDART_WHEELS, preferred):
        wheel, relative = CUDART_WHEELS[major]
        candidates += [Candidate(str(root / relative), f"{wheel} wheel", major)
                       for root in nvidia_roots() if (root / relative).exists()]
    layouts = " or ".join(f"nvidia/{relative}" for _, relative in CUDART_WHEELS.values())
    return Step(tuple(candidates), f"CUDA runtime wheels: not installed (no {layouts} on sys.path)", why)


def cudart_system_step(preferred: int | None, why: str) -> Step:
    """The system's runtimes by versioned name, the preferred major's first; bare ``libcudart.so`` (a toolkit's
    development link, whatever major it is) last."""
    names = [Candidate(f"libcudart.so.{major}", "system loader", major)
             for major in _by_preference(CUDART_WHEELS, preferred)]
    return Step((*names, Candidate("libcudart.so", "system loader")), preference=why)


def cudart_steps() -> Iterator[Step]:
    """The runtime's places in order. The preferred CUDA major is worked out (which loads NCCL, or asks the
    driver) only when no override and no runtime already loaded has settled it."""
    yield override_step("cudart_library", CUDART_ENV)
    yield loaded_step(_CUDART_MAPPED, "libcudart.so*")
    preferred, why = preferred_cuda_major()
    yield cudart_wheel_step(preferred, why)
    yield cudart_system_step(preferred, why)


@functools.lru_cache(maxsize=1)
def cudart_search() -> Search:
    """This process's CUDA runtime, searched once (loading is for good)."""
    return search("CUDA runtime library", CUDART_ENV, cudart_steps())


# --- what hora check prints ------------------------------------------------------------------------------


def cudart_version(lib: ctypes.CDLL) -> str | None:
    """``cudaRuntimeGetVersion`` as ``"13.0"``; needs no GPU."""
    code = _version_code(lib, "cudaRuntimeGetVersion")
    return None if code is None else f"{code // 1000}.{code % 1000 // 10}"


def report_lines(nccl_version: str | None) -> list[str]:
    """Which NCCL and which CUDA runtime this process uses (file, version, source), or every place tried."""
    runtime = cudart_search()
    version = cudart_version(runtime.lib) if runtime.lib is not None else None
    return nccl_search().describe(nccl_version) + runtime.describe(version)
