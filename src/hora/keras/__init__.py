"""hora.keras: horovod.tensorflow.keras's API for Keras 3.

Change ``import horovod.tensorflow.keras as hvd`` to ``import hora.keras as hvd`` (or keep the
Horovod spelling with ``import hora.tensorflow.keras as hvd``). Works on the TensorFlow backend
and, since hora reduces through NumPy, on the torch backend (``KERAS_BACKEND=torch``); the backend
is whatever Keras was imported with. Nothing here imports TensorFlow unless Keras runs on it.
With ``TF_USE_LEGACY_KERAS=1`` (and the tf-keras package) the same names serve Keras 2 models and
optimizers, as Horovod's did: see :mod:`hora.tensorflow.keras2`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora import collectives
from hora.basics import Average, ProcessSet, global_process_set
from hora.binding.common_api import *  # noqa: F403 - re-exported: lifecycle, topology, reduce ops, process sets, errors
from hora.binding.common_api import __all__ as _common
from hora.collectives import allgather_object, broadcast_object
from hora.compression import Compression
from hora.keras import callbacks, elastic
from hora.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
from hora.keras_wrapper import to_numpy


def _array(value: Any) -> np.ndarray:
    return to_numpy(value)


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: int | None = None, compression=Compression.none,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce a value (tensor, variable, array or number) across ranks; returns a NumPy array."""
    compressed, ctx = compression.compress(_array(value))
    reduced = collectives.allreduce(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allgather(value: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Every rank's value concatenated along the first dimension, as a NumPy array."""
    return collectives.allgather(_array(value), name, process_set)


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """``root_rank``'s value on every rank, as a NumPy array."""
    return collectives.broadcast(_array(value), root_rank, name, process_set)


def reducescatter(value: Any, name: str | None = None, op: int = Average,
                  process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce across ranks and keep this rank's block of rows, as a NumPy array."""
    return collectives.reducescatter(_array(value), name, op, process_set)


def broadcast_global_variables(root_rank: int) -> None:
    """Keras 3 has no global variable collection; use BroadcastGlobalVariablesCallback (Horovod raises too)."""
    raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution (Keras 3 keeps no "
                       "global variable collection). Use hora.keras.callbacks.BroadcastGlobalVariablesCallback"
                       "(root_rank) in model.fit, or hora.keras.callbacks.broadcast_model_state(model, root_rank).")


__all__ = list(_common) + [
    "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "callbacks", "elastic",
    "allreduce", "allgather",
    "broadcast", "reducescatter", "broadcast_global_variables", "broadcast_object", "allgather_object",
]
