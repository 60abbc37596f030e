"""The ray extra alone: hora.ray's RayExecutor starts a 2-worker hora job on a local Ray (2 CPUs)
and runs a function that reduces across the workers; run as plain ``python smoke_ray.py`` (Ray, not
``hora run``, starts the workers).

The function is defined here, in ``__main__``, so cloudpickle ships it by value: the Ray workers
need nothing from this folder on their path.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from smoke_report import report  # this folder: on the path of a script run from it

from hora.ray import RayExecutor


def reduce_on_each_worker() -> dict[str, Any]:
    import numpy as np

    import hora

    hora.init()
    summed = hora.allreduce(np.array([1.0 + hora.rank(), 10.0]), op=hora.Sum, name="smoke.sum")
    gathered = hora.allgather_object(os.getpid())
    return {"rank": hora.rank(), "size": hora.size(), "sum": summed.tolist(), "pids": gathered}


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2, cpus_per_worker=1)
        executor.start()
        try:
            results = executor.run(reduce_on_each_worker)
        finally:
            executor.shutdown()
    finally:
        ray.shutdown()
    for result in results:
        result["driver_pid"] = os.getpid()
        report(result)


if __name__ == "__main__":
    main()
