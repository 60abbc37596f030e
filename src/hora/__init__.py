"""hora: Horovod-compatible distributed training in pure Python.

``import hora as hvd`` gives Horovod's API on NumPy arrays; ``hora.torch`` and the other bindings
give the same on framework tensors. ``hora.run`` starts a function on several worker processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hora.common_api import *  # noqa: F401,F403 - lifecycle, topology, reduce ops, process sets, errors
from hora.collectives import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from hora.errors import HorovodInternalError, HoraError, HostsUpdatedInterrupt

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hora.runner.api import run as run


def __getattr__(name: str) -> Any:
    # ``hora.run`` is :func:`hora.runner.api.run` itself, loaded on first use: launching needs the
    # runner, a worker importing hora does not.
    if name == "run":
        from hora.runner.api import run

        return run
    raise AttributeError(f"module 'hora' has no attribute {name!r}")
