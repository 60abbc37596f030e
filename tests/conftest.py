"""Fixtures every test directory shares.

pytest puts this directory on ``sys.path``, so helper modules here (``sections``) import by name,
and ``hora.run`` hands that path on to the workers it starts.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

import hora


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without hora's identity and knob variables, plus ``extra``: what a
    job started from a test should see, whatever the shell running pytest has set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(extra or {})
    return env


@pytest.fixture
def no_hora_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HORA_*/HOROVOD_* variables: ``hora.init()`` then forms a private size-1 job."""
    for key in list(os.environ):
        if key.startswith(("HORA_", "HOROVOD_")):
            monkeypatch.delenv(key)


@pytest.fixture
def uninitialised(no_hora_env) -> Iterator[None]:
    """hora not initialised in this process when the test starts, and not left initialised after it,
    whatever tests ran before."""
    hora.shutdown()
    assert not hora.is_initialized()
    yield
    hora.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _no_initialised_hora_across_modules() -> Iterator[None]:
    """A module may keep one in-process job across its tests (starting one costs time), but never
    hands it to the next module."""
    yield
    hora.shutdown()
