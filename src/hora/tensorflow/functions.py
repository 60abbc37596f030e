"""Helpers that make every rank start from the same state: variables (eagerly, in ``tf.function`` and in
TensorFlow 1 graphs, with ``BroadcastGlobalVariablesHook``) and Python objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hora import collectives
from hora.basics import ProcessSet, global_process_set
from hora.tensorflow.mpi_ops import assign_from_root


def broadcast_variables(variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Overwrite each variable with ``root_rank``'s value (``tf.Variable`` or Keras variables).

    All variables travel in one engine round. In a TensorFlow 1 graph it returns the op that does it
    (what ``Session.run`` needs); eagerly and inside ``tf.function`` (which runs the assignments
    through its automatic control dependencies) it returns None, so a function may return it.
    ``inplace`` is Horovod's choice of kernel; in hora both ways assign the broadcast values.
    """
    assignments = assign_from_root(list(variables), root_rank, process_set=process_set)
    if tf.executing_eagerly() or tf.inside_function():
        return None
    return tf.group(*assignments)


def broadcast_global_variables(root_rank: int) -> Any:
    """An op that broadcasts TensorFlow 1's global variables from ``root_rank`` (graph mode).

    Build it in the graph (``tf.compat.v1``) and run it once the variables are initialised, or let
    :class:`BroadcastGlobalVariablesHook` run it. Eagerly TensorFlow 2 keeps no such collection: as
    in Horovod, refused.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution (TensorFlow 2 keeps "
                           "no global variable collection). Use hvd.broadcast_variables(model.variables, "
                           "root_rank) or hora.keras.callbacks.BroadcastGlobalVariablesCallback instead.")
    variables = tf.compat.v1.global_variables()
    if not variables and tf.inside_function():
        raise RuntimeError("hvd.broadcast_global_variables() inside tf.function: TensorFlow 2 keeps no global "
                           "variable collection there. Use hvd.broadcast_variables(variables, root_rank).")
    return broadcast_variables(variables, root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts every global variable from ``root_rank`` once the session exists (TensorFlow 1).

    Pass it in ``hooks`` of ``tf.compat.v1.train.MonitoredTrainingSession`` (or any
    ``MonitoredSession``): every rank then starts from the root's initial or restored weights.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self) -> None:
        # a new graph (a second MonitoredSession) needs its own op
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord) -> None:
        session.run(self.bcast_op)


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
