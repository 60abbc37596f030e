"""hora.mxnet: horovod.mxnet's API on hora. Change ``import horovod.mxnet as hvd`` to
``import hora.mxnet as hvd``; everything else stays. MXNet 1.9.1 needs numpy<1.24, so it lives in its
own environment (docs/mxnet.md)."""

from __future__ import annotations

from hora.common_api import *  # noqa: F401,F403 - lifecycle, topology, reduce ops, process sets, errors
from hora.mxnet.compression import Compression
from hora.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters
from hora.mxnet.mpi_ops import (
    allgather,
    allgather_async,
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
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from hora.mxnet.optimizer import DistributedOptimizer, DistributedTrainer
