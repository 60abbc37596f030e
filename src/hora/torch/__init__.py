"""hora.torch: horovod.torch's API on hora. Change ``import horovod.torch as hvd`` to
``import hora.torch as hvd``; everything else stays."""

from __future__ import annotations

from hora.binding.common_api import *  # noqa: F403 - re-exported: lifecycle, topology, reduce ops, process sets, errors
from hora.torch import elastic as elastic  # hvd.elastic.run, as after `import horovod.torch as hvd`
from hora.torch.compression import Compression as Compression
from hora.torch.functions import (
    allgather_object as allgather_object,
    broadcast_object as broadcast_object,
    broadcast_optimizer_state as broadcast_optimizer_state,
    broadcast_parameters as broadcast_parameters,
)
from hora.torch.mpi_ops import (
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
    sparse_allreduce_async as sparse_allreduce_async,
    synchronize as synchronize,
)
from hora.torch.optimizer import DistributedOptimizer as DistributedOptimizer
from hora.torch.sharded_join import join as join
from hora.torch.sync_batch_norm import SyncBatchNorm as SyncBatchNorm
from hora.torch.zero import ZeroRedundancyOptimizer as ZeroRedundancyOptimizer
from hora.torch.zero_memory import MemoryReport as MemoryReport, memory_report as memory_report
