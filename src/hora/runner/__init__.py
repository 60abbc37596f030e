"""The runner layer: launching workers, their output and failure propagation.

Modules, one job each: :mod:`locality` (is a host this machine?), :mod:`worker_env` (each worker's
environment), :mod:`process` (spawning and signalling process groups), :mod:`output` (prefixed output
forwarding), :mod:`launch` (supervising workers), :mod:`job` (a local job with its rendezvous store),
:mod:`run_args` (``hora run`` options), :mod:`check` (``hora check``), :mod:`api` (``hora.run``),
:mod:`task` (the worker side of ``hora.run``) and :mod:`mpi_launch` (``hora run --mpi``). Host lists,
rank layout and a worker's identity belong to :mod:`hora.workers`, below the runtime.

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
