"""The names every framework binding re-exports unchanged: Horovod's lifecycle, topology, reduce ops,
process sets and errors.

``hora``, ``hora.torch``, ``hora.tensorflow`` and ``hora.keras`` take them with
``from hora.binding.common_api import *``, so that ``hvd.init()``, ``hvd.rank()``, the reduce ops, process
sets and Horovod's error classes are the very same objects whichever binding a script imports.
"""

from __future__ import annotations

from hora.basics import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    bytes_sent,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hora.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set", "bytes_sent", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "remove_process_set", "rocm_built", "shutdown", "size",
    "start_timeline", "stop_timeline", "HorovodInternalError", "HostsUpdatedInterrupt",
]
