"""Over real OpenSSH: the launcher's failure line names the Python exception of a remote rank."""

from __future__ import annotations

import pytest
from cluster_helpers import hora_run_argv

pytestmark = pytest.mark.timeout(90)

RAISE_ON_RANK_2 = (
    "import os, time\n"
    "if os.environ['HORA_RANK'] == '2':\n"
    "    raise ValueError('bad input on ' + os.environ['HORA_HOSTNAME'])\n"
    "time.sleep(60)\n"
)


def test_cluster_remote_rank_exception_is_in_the_failure_line_world_size_4(cluster, launcher):
    h2 = cluster.hosts[1]
    proc = launcher(hora_run_argv(cluster, 4, cluster.host_list(2, count=2), "-c", RAISE_ON_RANK_2))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    final = [line for line in err.splitlines() if line.startswith("hora run: rank ")]
    assert final, err
    assert final[-1].startswith(
        f"hora run: rank 2 on {h2.address} exited with status 1: ValueError: bad input on {h2.address}"), err
