"""hora.mxnet: horovod.mxnet's API on hora. Change ``import horovod.mxnet as hvd`` to
``import hora.mxnet as hvd``; everything else stays. MXNet 1.9.1 needs numpy<1.24, so it lives in its
own environment (docs/mxnet.md)."""

from __future__ import annotations

from hora.binding.common_api import *  # noqa: F403 - re-exported: lifecycle, topology, reduce ops, process sets, errors
from hora.mxnet.compression import Compression as Compression
from hora.mxnet.functions import (
    allgather_object as allgather_object,
    broadcast_object as broadcast_object,
    broadcast_parameters as broadcast_parameters,
)
from hora.mxnet.mpi_ops import (
    allgather as allgather,
    allgather_async as allgather_async,
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
    grouped_allgather as grouped_allgather,
    grouped_allgather_async as grouped_allgather_async,
    grouped_allreduce as grouped_allreduce,
    grouped_allreduce_ as grouped_allreduce_,
    grouped_allreduce_async as grouped_allreduce_async,
    grouped_allreduce_async_ as grouped_allreduce_async_,
    grouped_reducescatter as grouped_reducescatter,
    grouped_reducescatter_async as grouped_reducescatter_async,
    poll as poll,
    reducescatter as reducescatter,
    reducescatter_async as reducescatter_async,
    synchronize as synchronize,
)
from hora.mxnet.optimizer import DistributedOptimizer as DistributedOptimizer, DistributedTrainer as DistributedTrainer
