"""The Rays of this folder, each started once per run and shared by the modules that need it:

- ``ray_local``: one local instance of 4 logical CPUs (test_ray_executor.py, test_ray_example.py);
- ``ray_gpu_nodes``: a test cluster of two nodes of 2 CPUs and 2 (declared) GPUs (test_ray_cluster.py);
- ``ray_cpu_nodes``: a test cluster of a head without CPUs and two nodes of one CPU, with fast node
  health checks (test_ray_elastic.py, test_ray_node_loss.py); tests may add or remove nodes.

Only one Ray runs in a process at a time, and starting one (its control store, a raylet per node,
their agents and prestarted workers) is among the slowest things these tests do. So a Ray is kept
for as long as the next test wants the same one, and the modules of this folder run grouped by the
Ray they need, so each starts once. The last one is shut down when this folder's last test is done.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from ray_testing import FAST_HEALTH_CHECKS, LOCAL_CPUS, SharedRay, local_ray, ray_test_cluster

_HERE = os.path.dirname(os.path.abspath(__file__))
_SHARED = SharedRay()
#: The fixtures that each start one of the Rays, in the order their modules run.
_RAYS = ("ray_gpu_nodes", "ray_cpu_nodes", "ray_local")


@pytest.fixture(scope="module")
def ray_local() -> Any:
    """The ``ray`` module, initialised on a local instance of ``LOCAL_CPUS`` CPUs."""
    return _SHARED.get("local", lambda: local_ray(LOCAL_CPUS))


@pytest.fixture(scope="module")
def ray_gpu_nodes() -> Any:
    """The ``ray.cluster_utils.Cluster`` of two nodes, each 2 CPUs and 2 GPUs."""
    node = {"num_cpus": 2, "num_gpus": 2}
    return _SHARED.get("gpu-nodes", lambda: ray_test_cluster([node, node]))


@pytest.fixture(scope="module")
def ray_cpu_nodes() -> Any:
    """The ``ray.cluster_utils.Cluster`` whose head has no CPUs (it holds the control store, so it
    must stay) and whose other nodes have one CPU each; this process, the driver, attaches to the
    head. Two such nodes when it starts; a module before may have added or removed some."""
    return _SHARED.get("cpu-nodes", lambda: ray_test_cluster([{"num_cpus": 0}, {"num_cpus": 1}, {"num_cpus": 1}],
                                                             system_config=FAST_HEALTH_CHECKS))


def _in_this_folder(item: pytest.Item | None) -> bool:
    return item is not None and os.path.dirname(os.path.abspath(str(item.path))) == _HERE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This folder's modules grouped by the Ray they use (in ``_RAYS`` order; modules using none
    first), their order kept otherwise, in the places this folder's tests had in the run."""
    places = [index for index, item in enumerate(items) if _in_this_folder(item)]
    group: dict[Any, int] = {}
    for index in places:
        names = getattr(items[index], "fixturenames", ())
        used = [rank for rank, name in enumerate(_RAYS, start=1) if name in names]
        if used:
            group[items[index].path] = min(used + [group.get(items[index].path, len(_RAYS))])
    ordered = sorted((items[index] for index in places), key=lambda item: group.get(item.path, 0))
    for index, item in zip(places, ordered):
        items[index] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After this folder's last test (its module fixtures finalised first), shut Ray down."""
    if not _in_this_folder(nextitem):
        _SHARED.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _SHARED.close()  # a run that stopped early (-x, Ctrl-C)
