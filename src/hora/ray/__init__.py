"""hora on Ray: horovod.ray's ``RayExecutor`` with hora's workers as Ray actors.

``from hora.ray import RayExecutor`` replaces ``from horovod.ray import RayExecutor``; see
docs/ray.md. Needs Ray: ``pip install "hora[ray]"``. Elastic jobs: ``ElasticRayExecutor``, or
``RayExecutor(min_workers=..., max_workers=...)`` (:mod:`hora.ray.elastic_executor`).
"""

try:
    import ray  # noqa: F401 - only to say what is missing
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('hora.ray needs Ray, which is not installed: pip install "hora[ray]"') from exc

from hora.ray import ray_logger
from hora.ray.elastic import RayHostDiscovery
from hora.ray.elastic_executor import ElasticRayExecutor, ElasticRaySettings
from hora.ray.executor import RayExecutor, RaySettings
from hora.ray.placement import PlacementGroupTimeoutError

__all__ = ["ElasticRayExecutor", "ElasticRaySettings", "PlacementGroupTimeoutError", "RayExecutor", "RayHostDiscovery",
           "RaySettings", "ray_logger"]
