"""Helpers that make every rank start from the same state: variables and Python objects."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from hora import collectives
from hora.basics import ProcessSet, global_process_set
from hora.tensorflow.mpi_ops import broadcast_


def broadcast_variables(variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> None:
    """Overwrite each variable with ``root_rank``'s value (``tf.Variable`` or Keras variables).

    All variables travel in one engine round. ``inplace`` is Horovod's choice of kernel; in hora
    both ways assign the broadcast values to the variables.
    """
    broadcast_(list(variables), root_rank, process_set=process_set)


def broadcast_global_variables(root_rank: int) -> None:
    """TensorFlow 1's global-variable collection; TensorFlow 2 has none (as in Horovod, refused)."""
    if tf.executing_eagerly() or not tf.compat.v1.global_variables():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution (TensorFlow 2 keeps "
                           "no global variable collection). Use hvd.broadcast_variables(model.variables, "
                           "root_rank) or hora.keras.callbacks.BroadcastGlobalVariablesCallback instead.")
    broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object on every rank (``session`` is TensorFlow 1's, unused)."""
    return collectives.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` (Horovod's TF1 helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order."""
    return collectives.allgather_object(obj, name, process_set)
