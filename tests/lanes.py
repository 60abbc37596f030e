"""How ``scripts/test`` splits the suite into lanes: pytest processes that run side by side.

A serial run leaves a third of a 2-core machine idle: many tests wait on a worker's start, a cooldown, a
peer's failure, or run one single-threaded process. Two lanes fill that time, and since each lane takes
whole folders (a folder's modules share jobs, Spark sessions and Ray clusters), no fixture is shared
across processes.

Run as a script, it prints one line per lane: the paths (relative to the repository's root) that lane's
pytest takes::

    python tests/lanes.py 2
"""

from __future__ import annotations

import sys
from pathlib import Path

#: Each folder's wall time in a serial full run (seconds, 2 cores, 2026-11-28). The lanes are balanced
#: on these (longest first, each to the lane with the least so far: the LPT rule), and each process runs
#: its folders longest first (tests/conftest.py). A folder missing here (a new one) counts as 0 s and
#: goes last; the figures only balance and order the run, so they need not be exact.
FOLDER_SECONDS = {
    "transport": 145, "spark": 128, "elastic": 103, "hora_ray": 87, "extras_alone": 84,
    "hora_tensorflow": 80, "examples": 72, "bench": 60, "hora_tf_keras": 54, "hora_jax": 53, "engine": 46,
    "mpi": 38, "hora_torch": 33, "runner": 30, "cluster": 28, "deploy": 27, "nccl": 27, "hora_mxnet": 26,
    "adasum": 23, ".": 22, "rendezvous": 17, "hora_lightning": 13, "docs_site": 6, "runtime": 4,
    "horovod_errors": 1,
}

#: Folders that must share a lane because they use one machine-wide thing that two processes must not
#: use at once: the emulated cluster's namespaces and sshd ports (cluster, deploy), and local Ray
#: clusters (hora_ray, and the ray extra's smoke run in extras_alone).
RUN_TOGETHER = (("cluster", "deploy"), ("hora_ray", "extras_alone"))

TOP = "."  # the test modules directly in tests/


def folders(tests_dir: Path) -> list[str]:
    """The folders of ``tests_dir`` that hold test modules, and ``"."`` when it holds some itself."""
    found = sorted(p.name for p in tests_dir.iterdir()
                   if p.is_dir() and not p.name.startswith((".", "_")) and any(p.rglob("test_*.py")))
    if any(tests_dir.glob("test_*.py")):
        found.append(TOP)
    return found


def split(names: list[str], count: int) -> list[list[str]]:
    """``names`` in ``count`` lanes of about equal serial time; the units of RUN_TOGETHER stay together."""
    units: list[list[str]] = []
    placed: set[str] = set()
    for group in RUN_TOGETHER:
        members = [name for name in group if name in names]
        if members:
            units.append(members)
            placed.update(members)
    units += [[name] for name in names if name not in placed]
    weighed = sorted(((sum(FOLDER_SECONDS.get(name, 0) for name in unit), unit) for unit in units),
                     key=lambda pair: -pair[0])
    lanes: list[list[str]] = [[] for _ in range(count)]
    loads = [0] * count
    for seconds, unit in weighed:
        lightest = loads.index(min(loads))
        lanes[lightest] += unit
        loads[lightest] += seconds
    return [lane for lane in lanes if lane]


def paths(lane: list[str], tests_dir: Path, root: Path) -> list[str]:
    """pytest's arguments for ``lane``: each folder, and the top-level modules for ``"."``."""
    out: list[str] = []
    for name in lane:
        if name == TOP:
            out += [str(p.relative_to(root)) for p in sorted(tests_dir.glob("test_*.py"))]
        else:
            out.append(str((tests_dir / name).relative_to(root)))
    return out


def main(argv: list[str]) -> int:
    count = int(argv[1]) if len(argv) > 1 else 2
    if count < 1:
        print("lanes: the number of lanes must be at least 1", file=sys.stderr)
        return 2
    tests_dir = Path(__file__).resolve().parent
    for lane in split(folders(tests_dir), count):
        print(" ".join(paths(lane, tests_dir, tests_dir.parent)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
