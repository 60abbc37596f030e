"""Where a Ray job's workers go: the placement group that reserves their resources.

A job sized by ``num_workers`` asks for one bundle per worker with the ``PACK`` strategy, so Ray
fills as few nodes as it can (ranks on one node share memory). A job sized by ``num_hosts`` asks for
one bundle per host, each holding ``num_workers_per_host`` workers' resources, with ``STRICT_SPREAD``:
every bundle on a different node, so the job really spans ``num_hosts`` nodes with the same number
of workers on each (a soft ``SPREAD`` could put two bundles on one node and break that promise). A
job started inside a placement group (a Ray Tune trial, say) uses that group instead, unless told
not to, and leaves it in place when it ends.

Nothing here waits without a bound: a group Ray cannot place within the time-out is removed, and the
error names what it waited for and what the cluster has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hora.errors import LaunchError

logger = logging.getLogger(__name__)


class PlacementGroupTimeoutError(LaunchError, TimeoutError):
    """Ray could not reserve the workers' resources within ``placement_group_timeout_s``.

    A ``TimeoutError``, as horovod.ray raises, and a :class:`hora.errors.LaunchError`.
    """


@dataclass(frozen=True)
class WorkerResources:
    """What one worker reserves: CPUs, and GPUs when the job uses them."""

    cpus: float
    gpus: float

    def bundle(self, workers: int = 1) -> dict[str, float]:
        """The bundle for ``workers`` workers (Ray refuses zero amounts, so those are left out)."""
        amounts = {"CPU": self.cpus * workers, "GPU": self.gpus * workers}
        return {name: amount for name, amount in amounts.items() if amount > 0}


@dataclass
class Placement:
    """The group the workers run in and which bundle each worker (in creation order) takes."""

    group: PlacementGroup
    bundle_of: list[int]  # -1: any bundle of a group this job did not create
    owned: bool  # created for this job, so removed when it ends

    def strategy_for(self, worker: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=self.bundle_of[worker],
                                                placement_group_capture_child_tasks=False)

    def release(self) -> None:
        """Give the reservation back (a borrowed group stays: its owner removes it)."""
        if self.owned:
            try:
                remove_placement_group(self.group)
            except Exception as exc:  # Ray may already be shutting down
                logger.debug("removing the placement group failed: %s", exc)


def reserve(num_workers: int, num_hosts: int | None, workers_per_host: int, resources: WorkerResources,
            timeout_s: float, use_current: bool) -> Placement:
    """Reserve the workers' resources: the current placement group when there is one and
    ``use_current`` allows it, else a new group, ready within ``timeout_s`` seconds or removed."""
    current = get_current_placement_group() if use_current else None
    if current is not None:
        logger.info("hora.ray: using the current placement group for %d workers "
                    "(use_current_placement_group=False makes a new one)", num_workers)
        return Placement(current, [-1] * num_workers, owned=False)
    if num_hosts is None:
        bundles = [resources.bundle() for _ in range(num_workers)]
        strategy = "PACK"
        bundle_of = list(range(num_workers))
    else:
        bundles = [resources.bundle(workers_per_host) for _ in range(num_hosts)]
        strategy = "STRICT_SPREAD"
        bundle_of = [host for host in range(num_hosts) for _ in range(workers_per_host)]
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementGroupTimeoutError(_not_placed(num_workers, bundles, strategy, timeout_s))
    return Placement(group, bundle_of, owned=True)


def _amounts(resources: dict[str, float], names: list[str]) -> str:
    return ", ".join(f"{name} {resources.get(name, 0):g}" for name in names)


def _not_placed(num_workers: int, bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> str:
    names = sorted({name for bundle in bundles for name in bundle})
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    spread = (f"; {strategy} needs {len(bundles)} different nodes and {alive} are alive"
              if strategy == "STRICT_SPREAD" else f" on {alive} alive node(s)")
    return (f"hora.ray: Ray could not place {num_workers} workers within placement_group_timeout_s="
            f"{timeout_s:g} s: waited for {len(bundles)} bundle(s) of {_amounts(bundles[0], names)} each "
            f"({strategy}), but the cluster has {_amounts(ray.cluster_resources(), names)} in total and "
            f"{_amounts(ray.available_resources(), names)} free{spread}. Add nodes (ray start), ask for "
            "fewer workers or resources per worker, or raise placement_group_timeout_s")
