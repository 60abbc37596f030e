"""The runner layer: launching workers, their output and failure propagation, grouped by concern.

- :mod:`hora.runner.launching`: the local job with its store, each worker's process, environment,
  output and exit, and ``hora run --mpi``;
- :mod:`hora.runner.ssh`: ranks on other hosts;
- :mod:`hora.runner.elastic`: the elastic driver, host discovery and plans;
- :mod:`hora.runner.commands`: ``hora run``'s options, ``hora check``, ``hora discover``;
- :mod:`api` (``hora.run``), :mod:`payload` (the function it ships) and :mod:`task` (its worker side).

Host lists, rank layout and a worker's identity belong to :mod:`hora.workers`, below the runtime.
Nothing is imported here up front; ``from hora.runner import run`` (Horovod's spelling of
:func:`hora.run`) loads :mod:`api` when it is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hora.runner.api import run as run


def __getattr__(name: str) -> Any:
    if name == "run":
        from hora.runner.api import run

        return run
    raise AttributeError(f"module 'hora.runner' has no attribute {name!r}")
