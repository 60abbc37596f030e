"""scripts/test's lanes (tests/lanes.py): every test module runs in exactly one lane, the folders that
must not run at the same time share one, and the lanes are balanced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lanes

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _modules_under(path: Path) -> set[Path]:
    return {path} if path.is_file() else set(path.rglob("test_*.py"))


def test_every_test_module_is_in_exactly_one_lane() -> None:
    printed = subprocess.run([sys.executable, str(TESTS / "lanes.py"), "2"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.splitlines()
    assert len(printed) == 2
    seen: list[Path] = []
    for line in printed:
        for arg in line.split():
            seen += sorted(_modules_under(ROOT / arg))
    assert len(seen) == len(set(seen))
    assert set(seen) == set(TESTS.rglob("test_*.py"))


def test_folders_that_share_a_machine_wide_resource_share_a_lane() -> None:
    split = lanes.split(lanes.folders(TESTS), 2)
    for group in lanes.RUN_TOGETHER:
        holding = [i for i, lane in enumerate(split) if set(group) & set(lane)]
        assert len(holding) == 1, (group, split)


def test_the_lanes_are_balanced_and_a_new_folder_still_runs() -> None:
    names = [*lanes.FOLDER_SECONDS, "a_new_folder"]
    split = lanes.split(names, 2)
    loads = [sum(lanes.FOLDER_SECONDS.get(name, 0) for name in lane) for lane in split]
    assert abs(loads[0] - loads[1]) <= max(lanes.FOLDER_SECONDS.values())
    assert sorted(name for lane in split for name in lane) == sorted(names)
    assert sorted(lanes.split(names, 1)[0]) == sorted(names)
