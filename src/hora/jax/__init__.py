"""hora.jax: Horovod's API for JAX (which Horovod itself never had).

``import hora.jax as hvd``: ``hvd.init()``, ``hvd.rank()``, collectives on jax.Arrays (also inside
``jax.jit``, as host callbacks), ``broadcast_parameters`` over pytrees, ``broadcast_object`` and an optax
``DistributedOptimizer``. See docs/jax.md.
"""

from __future__ import annotations

from hora.common_api import *  # noqa: F401,F403 - lifecycle, topology, reduce ops, process sets, errors
from hora.compression import Compression
from hora.jax.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.jax.mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from hora.jax.optimizer import DistributedOptimizer
