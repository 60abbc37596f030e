"""Shared helpers for the engine tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def no_hora_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HORA_*/HOROVOD_* variables: ``hora.init()`` then forms a private size-1 job."""
    for key in list(os.environ):
        if key.startswith(("HORA_", "HOROVOD_")):
            monkeypatch.delenv(key)


def job_env(**knobs: object) -> dict[str, str]:
    """Worker environment entries for hora knobs, e.g. ``job_env(cycle_time=1)``."""
    return {f"HORA_{key.upper()}": str(value) for key, value in knobs.items()}
