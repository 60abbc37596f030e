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

