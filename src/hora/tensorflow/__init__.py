"""hora.tensorflow: horovod.tensorflow's API on TensorFlow 2 (2.16+, Keras 3).

Change ``import horovod.tensorflow as hvd`` to ``import hora.tensorflow as hvd``; everything else
stays. Collectives work eagerly, inside ``tf.function`` and in TensorFlow 1 graphs run by a
``tf.compat.v1.Session`` (not under XLA: ``jit_compile=True`` cannot host them).
``hora.tensorflow.keras`` is ``hora.keras`` under Horovod's spelling.
"""

from __future__ import annotations

from hora.binding.common_api import *  # noqa: F403 - re-exported: lifecycle, topology, reduce ops, process sets, errors
from hora.binding.common_api import __all__ as _common
from hora.compression import Compression
from hora.tensorflow.functions import (
    BroadcastGlobalVariablesHook,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hora.tensorflow.gradients import DistributedGradientTape, PartialDistributedGradientTape
from hora.tensorflow.mpi_ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from hora.tensorflow.optimizer import DistributedOptimizer
from hora.tensorflow.sync_batch_norm import SyncBatchNormalization

__all__ = list(_common) + [
    "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "PartialDistributedGradientTape", "SyncBatchNormalization",
    "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "join", "local_rank_op",
    "local_size_op", "process_set_included_op", "rank_op", "reducescatter", "size_op",
]

from hora.tensorflow import elastic as elastic  # hvd.elastic.run, as after `import horovod.tensorflow as hvd`
