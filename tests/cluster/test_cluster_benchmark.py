"""Smoke test of benchmarks/cluster_allreduce.py on the session's emulated cluster (4 hosts, 1 Gbit/s)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
from cluster_helpers import REPO, clean_env

SCRIPT = REPO / "benchmarks" / "cluster_allreduce.py"


def _module():
    spec = importlib.util.spec_from_file_location("cluster_allreduce", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ring_bound_formula():
    bound = _module().ring_bound_seconds
    # 64 MiB over 4 ranks on 1 Gbit/s links: 1.5 * 64 MiB / 125 MB/s.
    assert math.isclose(bound(64 * 2**20, 4, 125e6), 1.5 * 64 * 2**20 / 125e6)
    assert bound(1000, 1, 1.0) == 0.0


@pytest.mark.timeout(60)
def test_cluster_allreduce_benchmark_small_world_size_4(cluster):
    argv = [sys.executable, str(SCRIPT), "--hosts", ",".join(h.address for h in cluster.hosts),
            *cluster.ssh_flags(), "--network-interfaces", cluster.interfaces_flag(),
            "--link-gbit", "1", "--size-mib", "1", "--iters", "2", "--warmup", "1", "--json",
            "--timeout", "45"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=55, env=clean_env(), cwd=str(REPO))
    assert result.returncode == 0, result.stdout + result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["ranks"] == 4 and row["size_bytes"] == 2**20 and row["iters"] == 2 and row["correct"]
    assert math.isclose(row["bound_s"], 1.5 * 2**20 / 125e6)
    assert 0 < row["best_s"] <= row["median_s"] < 30
    assert math.isclose(row["best_over_bound"], row["best_s"] / row["bound_s"])


@pytest.mark.timeout(60)
def test_emulated_hosts_take_the_requested_tcp_congestion_control(cluster):
    from emucluster import EmulatedCluster

    with EmulatedCluster(2, tcp_congestion="reno") as own:
        for host in own.hosts:
            got = subprocess.run(host.exec_argv(["sysctl", "-n", "net.ipv4.tcp_congestion_control"]),
                                 capture_output=True, text=True, timeout=10)
            assert got.stdout.strip() == "reno", got.stdout + got.stderr


def test_tcp_congestion_flag_is_refused_for_real_hosts():
    result = subprocess.run([sys.executable, str(SCRIPT), "--hosts", "h1,h2", "--tcp-congestion", "reno"],
                            capture_output=True, text=True, timeout=30, env=clean_env(), cwd=str(REPO))
    assert result.returncode == 2 and "--tcp-congestion" in result.stderr and "--hosts" in result.stderr


@pytest.mark.timeout(400)
def test_cluster_compression_benchmark_on_two_shaped_hosts(cluster):
    """benchmarks/cluster_compression.py on two of the session's hosts (1 Gbit/s links) trains the
    200-tensor MLP uncompressed and with hora's PowerSGD: both report their speed, and hora's
    transports count PowerSGD's bytes per step as a small part of the plain run's. (DDP's contenders
    run in the full benchmark; their PowerSGD hook is smoke-tested on one host in tests/bench.) Each
    run may take 150 s: in CI every emulated host shares the 2 cores with the other lane's tests."""
    pytest.importorskip("torch")
    argv = [sys.executable, str(REPO / "benchmarks" / "cluster_compression.py"), "--hosts",
            ",".join(h.address for h in cluster.hosts[:2]), *cluster.ssh_flags(), "--network-interfaces",
            cluster.interfaces_flag(), "--hosts-list", "2", "--models", "mlp200", "--only", "hora,hora-powersgd",
            "--steps", "2", "--warmup", "2", "--json", "--timeout", "150"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=380, env=clean_env(), cwd=str(REPO))
    assert result.returncode == 0, result.stdout + result.stderr
    entry = json.loads(result.stdout)["results"]["2"]["mlp200"]
    rows = entry["rows"]
    assert all(rows[c]["img_sec"] > 0 for c in ("hora", "hora-powersgd")), rows
    assert rows["hora-powersgd"]["bytes_per_step"] < 0.1 * rows["hora"]["bytes_per_step"], rows
    assert set(entry["ratios"]) == {"hora-powersgd/hora"}, entry
