"""Fixtures every test directory shares.

pytest puts this directory on ``sys.path``, so helper modules here (``sections``, ``job_env``) import by name,
and ``hora.run`` hands that path on to the workers it starts.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

import hora
from hora import basics
from job_env import is_hora_variable


@pytest.fixture
def no_hora_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HORA_*/HOROVOD_* variables: ``hora.init()`` then forms a private size-1 job."""
    for key in list(os.environ):
        if is_hora_variable(key):
            monkeypatch.delenv(key)


@pytest.fixture
def uninitialised(no_hora_env) -> Iterator[None]:
    """hora not initialised in this process when the test starts (as in a fresh process: no
    rendezvous round remembered either), and not left initialised after it, whatever tests ran before."""
    basics.reset()
    assert not hora.is_initialized()
    yield
    basics.reset()


@pytest.fixture(scope="module", autouse=True)
def _no_initialised_hora_across_modules() -> Iterator[None]:
    """A module may keep one in-process job across its tests (starting one costs time), but never
    hands it to the next module."""
    yield
    hora.shutdown()
