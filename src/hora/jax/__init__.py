"""hora.jax: Horovod's API for JAX (which Horovod itself never had).

``import hora.jax as hvd``: ``hvd.init()``, ``hvd.rank()``, collectives on jax.Arrays (also inside
``jax.jit``, as host callbacks), ``broadcast_parameters`` over pytrees, ``broadcast_object`` and an optax
``DistributedOptimizer``. See docs/jax.md.
"""

from __future__ import annotations

from hora.binding.common_api import *  # noqa: F403 - re-exported: lifecycle, topology, reduce ops, process sets, errors
from hora.compression import Compression as Compression
from hora.jax.functions import (
    allgather_object as allgather_object,
    broadcast_object as broadcast_object,
    broadcast_optimizer_state as broadcast_optimizer_state,
    broadcast_parameters as broadcast_parameters,
)
from hora.jax.mpi_ops import (
    allgather as allgather,
    allgather_async as allgather_async,
    allreduce as allreduce,
    allreduce_async as allreduce_async,
    alltoall as alltoall,
    alltoall_async as alltoall_async,
    barrier as barrier,
    broadcast as broadcast,
    broadcast_async as broadcast_async,
    grouped_allgather as grouped_allgather,
    grouped_allgather_async as grouped_allgather_async,
    grouped_allreduce as grouped_allreduce,
    grouped_allreduce_async as grouped_allreduce_async,
    grouped_reducescatter as grouped_reducescatter,
    grouped_reducescatter_async as grouped_reducescatter_async,
    join as join,
    poll as poll,
    reducescatter as reducescatter,
    reducescatter_async as reducescatter_async,
    synchronize as synchronize,
)
from hora.jax.optimizer import DistributedOptimizer as DistributedOptimizer
from hora.jax.sharded_checkpoint import (
    consolidate_sharded_state as consolidate_sharded_state,
    reshard_state as reshard_state,
)
