"""benchmarks/gpu_suite.py on a machine without a GPU: it refuses in one line, and its arithmetic and
report (what docs/gpu.md keeps) are right for results a GPU run would produce."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from job_env import clean_env

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu_suite.py"

pytestmark = pytest.mark.timeout(120)


def _suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_the_suite_refuses_in_one_line(tmp_path):
    suite = _suite()
    if suite.probe_gpu().get("available"):
        pytest.skip("this machine has a GPU: the suite would run")
    done = subprocess.run([sys.executable, str(SUITE), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, env=clean_env(), timeout=100, cwd=REPO)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_suite: needs a CUDA GPU, and there is none here: ")
    assert "torch" in lines[0]  # why: no torch, no CUDA build, or no device
    assert not (tmp_path / "out" / "gpu_suite.json").exists()


def test_unknown_step_is_refused_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, str(SUITE), "--out", str(tmp_path), "--only", "np1,np9"],
                          capture_output=True, text=True, env=clean_env(), timeout=60, cwd=REPO)
    assert done.returncode == 2 and "unknown steps ['np9']" in done.stderr


def test_throughput_is_the_median_round_of_all_ranks_together():
    suite = _suite()
    rows = suite.throughput_rows({"hora/fp32": [2.0, 1.0, 4.0], "plain/fp32": [1.0, 1.0, 1.0]},
                                 images_per_rank=640, ranks=2)
    assert rows["hora/fp32"] == {"images_per_s": 640.0, "min": 320.0, "max": 1280.0, "rounds": 3}
    assert suite.ratio(rows, "hora/fp32", "plain/fp32") == 0.5
    assert suite.ratio(rows, "hora/bf16", "plain/fp32") is None


def test_junit_counts_name_what_did_not_pass(tmp_path):
    suite = _suite()
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="tests.nccl.a" name="ok"/>'
                     '<testcase classname="tests.nccl.a" name="bad"><failure message="x"/></testcase>'
                     '<testcase classname="tests.nccl.b" name="setup"><error message="y"/></testcase>'
                     '<testcase classname="tests.nccl.b" name="later"><skipped message="z"/></testcase>'
                     '</testsuite></testsuites>')
    assert suite.junit_counts(str(junit)) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1,
                                              "not_passed": ["tests.nccl.a::bad", "tests.nccl.b::setup"]}


def test_report_shows_each_step_and_its_figures():
    suite = _suite()
    report = {
        "date": "2026-11-27", "seconds": 301.4, "ok": False,
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0"},
        "steps": {
            "tests": {"ok": True, "passed": 90, "failed": 0, "errors": 0, "skipped": 2, "not_passed": [],
                      "step_seconds": 50.2},
            "np1": {"ok": False, "ratios": {"fp32": 0.99, "bf16": 0.95}, "step_seconds": 80,
                    "rows": {"plain/fp32": {"images_per_s": 1000.0, "min": 990.0, "max": 1010.0, "rounds": 3}}},
            "killed_peer": {"ok": True, "seconds_to_raise": 0.31, "survivor": {"type": "HorovodInternalError"},
                            "path": "host staging", "step_seconds": 20},
            "bench": {"ok": False, "error": "no result within its 120 s limit", "step_seconds": 120},
            "two_ranks_auto": {"ok": None, "returncode": 1, "said": "hora bench: error: a|b", "step_seconds": 9},
        },
    }
    text = suite.format_markdown(report)
    assert text.startswith("### 2026-11-27: NVIDIA H100 80GB HBM3 (torch 2.11.0, CUDA 13.0)")
    assert "Suite FAIL in 301 s." in text
    assert "| tests | pass | 50 | 90 passed, 0 failed, 0 errors, 2 skipped |" in text
    assert "| np1 | FAIL | 80 | fp32: hora/plain PyTorch 0.990, bf16: hora/plain PyTorch 0.950 |" in text
    assert "| killed_peer | pass | 20 | survivor raised HorovodInternalError after 0.31 s (host staging) |" in text
    assert "| bench | FAIL | 120 | no result within its 120 s limit |" in text
    assert "| two_ranks_auto | (information) | 9 | exit 1: hora bench: error: a/b |" in text
    assert "| plain/fp32 | 1000.0 | 990.0 | 1010.0 | - |" in text
