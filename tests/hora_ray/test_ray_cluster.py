"""hora.ray.RayExecutor across nodes of Ray's own multi-node test cluster (every node on this machine).

Ranks are grouped by Ray node, so local and cross ranks follow where Ray placed the actors, and the
transport sees each Ray node as one host (HORA_HOST_ID): shared memory inside a node, TCP across.
The nodes declare two (unreal) GPUs each, which is enough to check what the workers are shown.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import hora  # noqa: E402
from hora.ray import PlacementGroupTimeoutError, RayExecutor  # noqa: E402


@pytest.fixture(scope="module")
def cluster(ray_gpu_nodes):
    """Two nodes of 2 CPUs and 2 GPUs each (conftest.py)."""
    return ray_gpu_nodes


def _placement() -> dict:
    import hora.basics

    hora.init()
    return {"rank": hora.rank(), "local_rank": hora.local_rank(), "local_size": hora.local_size(),
            "cross_rank": hora.cross_rank(), "cross_size": hora.cross_size(),
            "node": ray.get_runtime_context().get_node_id(),
            "world": type(hora.basics._ctx.runtime.world).__name__,
            "sum": float(hora.allreduce(np.array([2.0 ** hora.rank()]), op=hora.Sum)[0])}


def test_two_hosts_of_two_workers_follow_the_ray_placement(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_hosts=2, num_workers_per_host=2)
    ex.start()
    try:
        found = ex.run(_placement)
    finally:
        ex.shutdown()
    assert [f["rank"] for f in found] == [0, 1, 2, 3]
    nodes = [f["node"] for f in found]
    # Ranks are numbered node by node: ranks 0, 1 on one node and 2, 3 on the other.
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert [(f["local_rank"], f["local_size"]) for f in found] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [(f["cross_rank"], f["cross_size"]) for f in found] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # Two hosts with two ranks each: shared memory inside each node, TCP rings across.
    assert {f["world"] for f in found} == {"HierarchicalCommunicator"}
    assert {f["sum"] for f in found} == {15.0}


def test_num_workers_are_packed_onto_one_node(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    ex.start()
    try:
        found = ex.run(_placement)
    finally:
        ex.shutdown()
    assert found[0]["node"] == found[1]["node"]
    assert [(f["local_rank"], f["local_size"], f["cross_size"]) for f in found] == [(0, 2, 1), (1, 2, 1)]
    assert {f["world"] for f in found} == {"ShmCommunicator"}


def test_gpu_workers_see_their_nodes_gpus_in_local_rank_order(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_hosts=2, num_workers_per_host=2,
                     use_gpu=True)
    ex.start()
    try:
        found = ex.run(lambda: (hora.init() or hora.local_rank(), os.environ["CUDA_VISIBLE_DEVICES"],
                                [str(g) for g in ray.get_gpu_ids()], ray.get_runtime_context().get_node_id()))
    finally:
        ex.shutdown()
    for local_rank, visible, own, node in found:
        assert len(own) == 1
        same_node = [f for f in found if f[3] == node]
        # Every worker of a node sees that node's job GPUs; device local_rank is its own.
        assert visible.split(",")[local_rank] == own[0]
        assert visible == ",".join(f[2][0] for f in sorted(same_node))


def test_more_hosts_than_nodes_fail_within_the_placement_timeout(cluster):
    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_hosts=3,
                     num_workers_per_host=1)
    with pytest.raises(PlacementGroupTimeoutError) as info:
        ex.start()
    message = str(info.value)
    assert "3 bundle(s) of CPU 1 each (STRICT_SPREAD)" in message, message
    assert "STRICT_SPREAD needs 3 different nodes and 2 are alive" in message, message


def test_elastic_discovery_counts_slots_by_cpus_and_gpus(cluster):
    """Two nodes of 2 CPUs and 2 (declared) GPUs: 2 workers per node at 1 CPU + 1 GPU, 1 at 1 CPU +
    2 GPUs, 4 at 0.5 CPU without GPUs; each node named by address and node id."""
    from hora.ray.elastic import RayHostDiscovery
    from hora.ray.placement import WorkerResources

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    for resources, per_node in ((WorkerResources(1, 1), 2), (WorkerResources(1, 2), 1), (WorkerResources(0.5, 0), 4)):
        found = RayHostDiscovery(resources).find()
        assert sorted(found.values()) == [per_node, per_node], (resources, found)
        assert sorted(label.rsplit("-", 1)[1] for label in found) == sorted(n[:8] for n in nodes)
