"""``hora bench --api numpy|torch``: the public allreduce path on a tiny 2-rank sweep (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from job_env import clean_env

from hora.bench.cli import main as bench_main
from hora.bench.sweep import bus_factor

TINY = ["-np", "2", "-b", "4", "-e", "1M", "-f", "64", "--iters", "3", "--warmup", "1"]
SIZES = [4, 256, 16384, 1048576]  # across the small slots and the pipelined path


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hora", "bench", *args], capture_output=True, text=True,
                          timeout=100, env=clean_env())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_bench_api_rows(api: str) -> None:
    proc = _bench("--api", api, *TINY, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for op in ("allreduce", "allreduce_") for s in SIZES]
    for row in rows:
        assert row["api"] == api and row["ranks"] == 2 and row["dtype"] == "float32", row
        assert row["count"] * 4 == row["size"] and row["iters"] >= 1, row
        assert 0 < row["time_us"] < 5e6 and len(row["per_rank_time_us"]) == 2, row
        assert row["time_us"] == pytest.approx(max(row["per_rank_time_us"])), row
        assert math.isclose(row["busbw"], row["size"] / row["time_us"] / 1e3 * bus_factor("allreduce", 2),
                            rel_tol=1e-6), row
        # After the warm-up the cache serves them (an idle round of the coordinator may still fall among them).
        assert row["named"] and row["negotiations"] < 1, row


@pytest.fixture(scope="module")
def unnamed_table() -> subprocess.CompletedProcess:
    """One tiny ``--api numpy --unnamed`` table, for the tests that read its title and its tables."""
    return _bench("--api", "numpy", *TINY[:6], "-e", "4", "--iters", "2", "--warmup", "0", "--unnamed")


def _refusal(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``hora bench ARGS`` writes to stderr as it exits with status 2 (before starting any job)."""
    with pytest.raises(SystemExit) as info:
        bench_main(args)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.timeout(120)
def test_bench_api_unnamed_calls_are_negotiated_every_time(unnamed_table: subprocess.CompletedProcess,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    proc = _bench("--api", "numpy", *TINY[:6], "-e", "256", "-f", "64", "--iters", "4", "--warmup", "1", "--unnamed",
                  "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for op in ("allreduce", "allreduce_") for s in (4, 256)]
    for row in rows:
        assert not row["named"] and row["negotiations"] >= 1, row
    table = unnamed_table
    assert table.returncode == 0 and "unnamed calls" in table.stdout, table.stderr + table.stdout
    assert "--unnamed needs --api" in _refusal(["--unnamed", "-e", "4"], capsys)


@pytest.mark.timeout(120)
def test_bench_api_table_and_refusals(unnamed_table: subprocess.CompletedProcess,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    proc = unnamed_table
    assert proc.returncode == 0, proc.stderr
    assert "public API on NumPy arrays" in proc.stdout and "# allreduce_" in proc.stdout, proc.stdout
    assert "allreduce and allreduce_ only" in _refusal(["--api", "torch", "--ops", "allgather", "-e", "4"], capsys)
