"""hora: Horovod-compatible distributed training in pure Python.

``import hora as hvd`` gives Horovod's API on NumPy arrays; ``hora.torch`` and the other bindings
give the same on framework tensors. ``hora.run`` starts a function on several worker processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hora.binding.common_api import *  # noqa: F403 - re-exported: lifecycle, topology, reduce ops, process sets, errors
from hora.collectives import (
    allgather as allgather,
    allgather_async as allgather_async,
    allgather_object as allgather_object,
    allreduce as allreduce,
    allreduce_ as allreduce_,
    allreduce_async as allreduce_async,
    allreduce_async_ as allreduce_async_,
    alltoall as alltoall,
    alltoall_async as alltoall_async,
    barrier as barrier,
    broadcast as broadcast,
    broadcast_ as broadcast_,
    broadcast_async as broadcast_async,
    broadcast_async_ as broadcast_async_,
    broadcast_object as broadcast_object,
    grouped_allgather as grouped_allgather,
    grouped_allgather_async as grouped_allgather_async,
    grouped_allreduce as grouped_allreduce,
    grouped_allreduce_ as grouped_allreduce_,
    grouped_allreduce_async as grouped_allreduce_async,
    grouped_allreduce_async_ as grouped_allreduce_async_,
    grouped_reducescatter as grouped_reducescatter,
    grouped_reducescatter_async as grouped_reducescatter_async,
    join as join,
    poll as poll,
    reducescatter as reducescatter,
    reducescatter_async as reducescatter_async,
    synchronize as synchronize,
)
from hora.errors import (
    HoraError as HoraError,
    HorovodInternalError as HorovodInternalError,
    HostsUpdatedInterrupt as HostsUpdatedInterrupt,
)
from hora.version import __version__ as __version__

if TYPE_CHECKING:
    from hora.runner.api import run as run


def __getattr__(name: str) -> Any:
    # ``hora.run`` is :func:`hora.runner.api.run` itself, loaded on first use: launching needs the
    # runner, a worker importing hora does not.
    if name == "run":
        from hora.runner.api import run

        return run
    raise AttributeError(f"module 'hora' has no attribute {name!r}")
