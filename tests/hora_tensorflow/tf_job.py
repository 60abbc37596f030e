"""Helpers for the hora.tensorflow / hora.keras tests: many named checks inside one multi-process job.

Every worker pays several seconds to import TensorFlow, so the test modules share jobs: each module
registers its section function with the job for its world size and environment (``shared_job``),
whose workers run every registered module's named sections and report each one's result or failure;
tests then read a section's value per rank. The section machinery is ``tests/sections.py``;
this module only adds the environment that keeps TensorFlow quiet and held to one compute thread
per worker (the CI box has two cores).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sections
from job_env import SKIP_IMPORTS, TENSORFLOW_OPTIONAL_IMPORTS
from sections import JobResults, SharedJob

TF_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "2",
    "OMP_NUM_THREADS": "1",
    # On a GPU, cuDNN convolutions default to TF32, whose rounding alone moves weights by ~1e-2 in
    # a few steps: the 1-worker-equals-2-workers checks compare in full float32.
    "NVIDIA_TF32_OVERRIDE": "0",
    # TensorFlow's optional imports that no binding test uses: a third of each worker's start-up.
    SKIP_IMPORTS: ",".join(TENSORFLOW_OPTIONAL_IMPORTS),
}

Sections = list[tuple[str, Callable[[], Any]]]


def run_job(func: Callable[[], Sections], np: int, env: dict[str, str] | None = None) -> JobResults:
    """Run ``func`` (which returns its sections; hora is initialised) on ``np`` workers."""
    return sections.run_job(func, np, {**TF_ENV, **(env or {})})


def shared_job(func: Callable[[], Sections], np: int, env: dict[str, str] | None = None, *,
               last: bool = False) -> SharedJob:
    """``func``'s share of the one job every TensorFlow module with this world size and environment
    runs (each of them would otherwise start its own workers and import TensorFlow again)."""
    return SharedJob(func, np, {**TF_ENV, **(env or {})}, last=last)


__all__ = ["JobResults", "run_job", "shared_job", "SharedJob", "TF_ENV"]
