"""A Ray node lost in the middle of ``RayExecutor.run``: run raises HorovodInternalError naming the
rank and the node, within a bound, instead of hanging. On a test cluster (a head and nodes of one
CPU for the workers: the one test_ray_elastic.py also uses, see conftest.py) that checks node health
every half second, so a lost node is noticed fast. The node taken away is never the one this
process, the driver, is attached to: Ray ends a driver whose own raylet dies.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import hora  # noqa: E402
from hora.errors import HorovodInternalError  # noqa: E402
from hora.ray import RayExecutor  # noqa: E402


@pytest.fixture(scope="module")
def cluster(ray_cpu_nodes):
    """A head without CPUs (it holds the cluster's control store, so it must stay) and nodes of one
    CPU for the workers, at least two (conftest.py; test_ray_elastic.py may have added some)."""
    while len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]) < 2:
        ray_cpu_nodes.add_node(num_cpus=1)
    ray_cpu_nodes.wait_for_nodes()
    return ray_cpu_nodes


def _train_until_stopped(ready_dir: str) -> str:
    hora.init()
    node = ray.get_runtime_context().get_node_id()
    # Written whole, then renamed: the test reads a file as soon as it sees its name.
    final = os.path.join(ready_dir, f"rank{hora.rank()}.json")
    with open(final + ".part", "w") as f:
        json.dump({"rank": hora.rank(), "node": node}, f)
    os.replace(final + ".part", final)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a training loop that only a failure ends
        hora.allreduce(np.ones(1024), name="gradient")
    return "the node was never lost"


def test_a_lost_node_makes_run_raise_horovod_internal_error_naming_rank_and_node(cluster, tmp_path):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_hosts=2, num_workers_per_host=1)
    ex.start()
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = ex.run(_train_until_stopped, args=[str(tmp_path)])
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    try:
        runner.start()
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
        assert len(ranks) == 2, "the workers never started training"
        # A node with a rank, but not the one this driver is attached to (losing that ends the driver).
        driver_node = ray.get_runtime_context().get_node_id()
        with_ranks = {r["node"] for r in ranks}
        doomed = next(node for node in cluster.worker_nodes
                      if node.node_id != driver_node and node.node_id in with_ranks)
        lost = next(r for r in ranks if r["node"] == doomed.node_id)
        began = time.monotonic()
        cluster.remove_node(doomed, allow_graceful=False)
        runner.join(timeout=90)
        assert not runner.is_alive(), "run() did not return after the node was lost"
        elapsed = time.monotonic() - began
    finally:
        ex.shutdown()
    error = outcome.get("error")
    assert isinstance(error, HorovodInternalError), outcome
    message = str(error)
    assert f"rank {lost['rank']} of 2" in message and lost["node"][:12] in message, message
    assert elapsed < 60, elapsed
    print(f"\nnode lost -> run raised in {elapsed:.1f} s: {message}")
