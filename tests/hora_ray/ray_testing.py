"""Real Ray for the tests: one local instance, or a multi-node test cluster, shared by the modules
that need the same one (:class:`SharedRay`, used by this folder's conftest).

Ray's test cluster (``ray.cluster_utils.Cluster``) runs every node as its own raylet on this
machine, all on one address, which is what makes node ids, not addresses, the thing hora.ray must
group ranks by. Both helpers start Ray without this process's hora variables (the raylet hands its
environment to every worker) and without the dashboard (start-up time).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from job_env import is_hora_variable


@contextlib.contextmanager
def _no_hora_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):
            if is_hora_variable(key):
                patch.delenv(key)
        yield


@contextlib.contextmanager
def local_ray(num_cpus: int, **kwargs: Any) -> Iterator[Any]:
    """``ray.init`` on this machine with ``num_cpus`` logical CPUs; shut down afterwards."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    with _no_hora_env():
        # address="local": a Ray of its own, never a cluster some other process started here.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()


@contextlib.contextmanager
def ray_test_cluster(nodes: list[dict[str, Any]], system_config: dict[str, Any] | None = None) -> Iterator[Any]:
    """A Ray test cluster whose head has ``nodes[0]``'s resources and each further node its entry's
    (``num_cpus``, ``num_gpus``...); this process is its driver. Yields the Cluster."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    head = {"include_dashboard": False, **nodes[0]}
    if system_config:
        head["_system_config"] = system_config
    with _no_hora_env():
        cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            for node in nodes[1:]:
                cluster.add_node(**node)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
        except BaseException:
            cluster.shutdown()
            raise
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


#: The logical CPUs of the local instance the single-node tests share.
LOCAL_CPUS = 4

#: The cluster checks node health every second and declares a node lost after 5 missed checks: a lost
#: node is noticed within seconds, and a raylet that a busy machine (two test folders at once) delays
#: for a second or two is not taken for a lost one.
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                      "health_check_failure_threshold": 5}


class SharedRay:
    """At most one Ray open (a local instance or a test cluster), kept while callers ask for the
    same one by name: a caller asking for another shuts it down and starts its own."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._context: contextlib.AbstractContextManager[Any] | None = None
        self._value: Any = None

    def get(self, name: str, start: Callable[[], contextlib.AbstractContextManager[Any]]) -> Any:
        """The Ray called ``name``, started with ``start()`` unless it is the one open."""
        if name != self._name:
            self.close()
            context = start()
            self._value = context.__enter__()
            self._context, self._name = context, name
        return self._value

    def close(self) -> None:
        context, self._context, self._name, self._value = self._context, None, None, None
        if context is not None:
            context.__exit__(None, None, None)


def alive_node_ids() -> set[str]:
    import ray

    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}
