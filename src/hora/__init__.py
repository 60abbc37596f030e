"""hora: Horovod-compatible distributed training in pure Python.

``import hora as hvd`` gives Horovod's API on NumPy arrays; ``hora.torch`` and the other bindings
give the same on framework tensors. ``hora.run`` starts a function on several worker processes.
"""

from __future__ import annotations

from typing import Any, Callable

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


def run(func: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, np: int = 1,
        hosts: str | None = None, **options: Any) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` workers and return each rank's result, in rank order.

    See :func:`hora.runner.api.run` for the options.
    """
    from hora.runner.api import run as _run

    return _run(func, args=args, kwargs=kwargs, np=np, hosts=hosts, **options)
