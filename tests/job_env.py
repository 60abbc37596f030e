"""The environment a job started from a test runs in.

Tests start real launchers and workers; whatever HORA_*/HOROVOD_* variables the shell running pytest
happens to have (a rank, a rendezvous address, a knob) must not leak into them.
"""

from __future__ import annotations

import os


def is_hora_variable(name: str) -> bool:
    """Whether ``name`` is one of hora's identity or knob variables (or Horovod's alias of one)."""
    return name.startswith(("HORA_", "HOROVOD_"))


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without hora's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not is_hora_variable(k)}
    env.update(extra or {})
    return env
