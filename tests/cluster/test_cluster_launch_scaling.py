"""Smoke test of benchmarks/scaling_cluster_launch.py on the session's emulated cluster: 2 hosts x 2
ranks over real OpenSSH, one clean run and one where a rank SIGKILLs itself."""

from __future__ import annotations

import sys

import pytest
from cluster_helpers import REPO


def _measure_launch():
    sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark imports its sibling scaling_one_host
    from scaling_cluster_launch import measure_launch

    return measure_launch


@pytest.mark.timeout(90)
def test_cluster_launch_measurement_counts_ssh_clients_and_names_a_killed_rank(cluster):
    measure = _measure_launch()
    hosts = [h.address for h in cluster.hosts[:2]]
    common = (hosts, cluster.ssh_flags(), cluster.interfaces_flag(), 2)
    row = measure(*common, 0.5, timeout=60)
    assert row["ranks_seen"] == 4 and row["exit_code"] == 0, row
    assert row["ssh_clients"] == 4, row  # one ssh client per remote rank, all alive while ranks run
    assert 0 < row["startup_s"] < row["exit_s"] and row["launcher_threads"] >= 2, row

    failed = measure(*common, 30.0, kill_rank=3, timeout=60)
    assert failed["exit_code"] == 137, failed
    assert failed["names_rank_and_host"], failed
    assert failed["message"].startswith(
        f"hora run: rank 3 on {hosts[1]} was killed by signal SIGKILL"), failed
    assert 0 < failed["kill_to_exit_s"] < 10, failed
