"""hora on Ray: horovod.ray's ``RayExecutor`` with hora's workers as Ray actors.

``from hora.ray import RayExecutor`` replaces ``from horovod.ray import RayExecutor``; see
docs/ray.md. Needs Ray: ``pip install "hora[ray]"``. Elastic Ray jobs (``ElasticRayExecutor``,
``min_workers``/``max_workers``) are not built yet and are refused.
"""

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('hora.ray needs Ray, which is not installed: pip install "hora[ray]"') from exc

from hora.ray import ray_logger
from hora.ray.executor import ElasticRayExecutor, RayExecutor, RaySettings
from hora.ray.placement import PlacementGroupTimeoutError

__all__ = ["ElasticRayExecutor", "PlacementGroupTimeoutError", "RayExecutor", "RaySettings", "ray_logger"]
