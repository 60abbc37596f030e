"""Helpers shared by the engine tests (imported by name: tests/engine is on sys.path under pytest,
and ``hora.run`` hands the launcher's sys.path to its workers)."""

from __future__ import annotations


def job_env(**knobs: object) -> dict[str, str]:
    """Worker environment entries for hora knobs, e.g. ``job_env(cycle_time=1)``."""
    return {f"HORA_{key.upper()}": str(value) for key, value in knobs.items()}
