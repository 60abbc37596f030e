"""``hora bench --api numpy|torch``: the public allreduce path on a tiny 2-rank sweep (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from hora.bench.sweep import bus_factor
from job_env import clean_env

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


@pytest.mark.timeout(120)
def test_bench_api_unnamed_calls_are_negotiated_every_time() -> None:
    proc = _bench("--api", "numpy", *TINY[:6], "-e", "256", "-f", "64", "--iters", "4", "--warmup", "1", "--unnamed",
                  "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for op in ("allreduce", "allreduce_") for s in (4, 256)]
    for row in rows:
        assert not row["named"] and row["negotiations"] >= 1, row
    table = _bench("--api", "numpy", *TINY[:6], "-e", "4", "--iters", "2", "--warmup", "0", "--unnamed")
    assert table.returncode == 0 and "unnamed calls" in table.stdout, table.stderr + table.stdout
    refused = _bench("--unnamed", "-e", "4")
    assert refused.returncode == 2 and "--unnamed needs --api" in refused.stderr, refused.stderr


@pytest.mark.timeout(120)
def test_bench_api_table_and_refusals() -> None:
    proc = _bench("--api", "numpy", *TINY[:6], "-e", "4", "--iters", "2", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    assert "public API on NumPy arrays" in proc.stdout and "# allreduce_" in proc.stdout, proc.stdout
    refused = _bench("--api", "torch", "--ops", "allgather", "-e", "4")
    assert refused.returncode == 2 and "allreduce and allreduce_ only" in refused.stderr, refused.stderr
