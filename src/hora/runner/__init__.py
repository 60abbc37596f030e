"""The runner layer: launching workers, their identity, output and failure propagation.

Modules, one job each: :mod:`hosts` (host lists and rank layout), :mod:`locality` (is a host this
machine?), :mod:`worker_env` (each worker's environment), :mod:`process` (spawning and signalling
process groups), :mod:`output` (prefixed output forwarding), :mod:`launch` (supervising workers),
:mod:`job` (a local job with its rendezvous store), :mod:`run_args` (``hora run`` options),
:mod:`check` (``hora check``), :mod:`api` (``hora.run``), :mod:`task` (the worker side of
``hora.run``) and :mod:`identity` (a worker reading who it is).

Nothing is imported here up front, so a worker importing :mod:`hora.runner.identity` pays only for
that; ``from hora.runner import run`` (Horovod's spelling of :func:`hora.run`) loads :mod:`api`
when it is asked for.
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
