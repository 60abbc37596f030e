"""Helpers for the hora.jax tests: many named checks inside one multi-process job (tests/sections.py),
with JAX held to one compute thread per worker (the CI box has two cores), 64-bit types enabled (so
int64/float64 exist) and two host devices (so a sharded array, an unsupported input, can be made)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sections
from sections import JobResults

JAX_ENV = {
    "JAX_ENABLE_X64": "1",
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false",
    "OMP_NUM_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def run_job(func: Callable[[], list[tuple[str, Callable[[], Any]]]], np: int,
            env: dict[str, str] | None = None) -> JobResults:
    """Run ``func`` (which returns its sections; hora is initialised) on ``np`` workers."""
    return sections.run_job(func, np, {**JAX_ENV, **(env or {})})


__all__ = ["JobResults", "run_job", "JAX_ENV"]
