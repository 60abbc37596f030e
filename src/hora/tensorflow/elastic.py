"""Elastic training for TensorFlow 2: ``run``, ``TensorFlowKerasState`` and ``TensorFlowState``
(horovod.tensorflow.elastic's names).

``run`` is :func:`hora.elastic.run` (re-form the world in this process with ``hora.shutdown()`` then
``hora.init()``) plus one thing TensorFlow needs: inside a ``tf.function`` (a custom training step,
or the step ``model.fit`` compiles) a hora collective is a ``tf.numpy_function``, and TensorFlow
reports whatever it raises as a ``tf.errors.OpError`` (UnknownError) carrying the original message.
``run`` recognises a failed collective there by the name of a
:class:`~hora.errors.HorovodInternalError` class in that message, as Horovod recognises its own ops'
names, and treats it as that error (restore the last commit, re-form, go on). The reset itself needs
nothing more than ``shutdown()``/``init()``: compiled functions keep calling hora's collectives,
which read the current world when they run, and unnamed collectives are numbered afresh by the new
world's engine on every rank alike.

The states keep variable values in memory (see :mod:`hora.elastic_variables`). Horovod's TensorFlow 1
paths (a ``tf.compat.v1.Session``, a Keras ``backend`` holding one, graph mode) are refused: hora
targets TensorFlow 2 eager execution.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import tensorflow as tf

from hora.elastic import run as _elastic_run
from hora.elastic_variables import KerasModelState, VariablesState
from hora.errors import HorovodInternalError

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState"]

R = TypeVar("R")


def _internal_error_names() -> set[str]:
    """HorovodInternalError and every subclass (TransportError, PeerFailureError...), by class name."""
    names: set[str] = set()
    pending = [HorovodInternalError]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return names


def _failed_collective(error: tf.errors.OpError) -> str | None:
    """The ``<class name>: <message>`` line of a HorovodInternalError that a hora collective raised
    inside a graph (as TensorFlow prints it in ``error``'s message), or None for any other error."""
    names = tuple(f"{name}: " for name in _internal_error_names())
    for line in (error.message or "").splitlines():
        if line.strip().startswith(names):
            return line.strip()
    return None


def _raising_internal_errors(func: Callable[..., R]) -> Callable[..., R]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as error:
            cause = _failed_collective(error)
            if cause is None:
                raise
            raise HorovodInternalError(f"a collective failed inside a TensorFlow graph: {cause}") from error

    return wrapper


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Horovod's ``hvd.elastic.run`` for TensorFlow: ``func(state, ...)`` survives failed peers and host
    changes by re-forming the world in this process (see :mod:`hora.elastic.loop`), including failures
    raised by collectives inside ``tf.function``\\ s and ``model.fit``."""
    return _elastic_run(_raising_internal_errors(func))


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise NotImplementedError(f"{what} needs TensorFlow 2 eager execution; hora does not support TensorFlow 1 "
                                  "graph mode (tf.compat.v1.disable_eager_execution, sessions)")


class TensorFlowKerasState(KerasModelState):
    """The training state of a Keras model on TensorFlow: weights, optimizer variables, attributes.

    ``save`` (each commit) copies ``model.weights`` and every optimizer variable to memory,
    ``restore`` assigns the copies back, ``sync`` broadcasts them from rank 0 along with the
    keyword-argument attributes (``epoch=0, batch=0``...). ``optimizer`` defaults to
    ``model.optimizer``. An optimizer not built yet (Keras 3 makes its slots on the first step) is
    built here, for ``model.trainable_variables``, exactly as Keras would: the first commit then
    holds its slots and the first sync gives every rank rank 0's, so there is no need for Horovod's
    advice of one training step before making the state. ``backend`` is Horovod's TensorFlow 1 Keras
    backend (for its session); in TensorFlow 2 it is kept and unused. The model must be built.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        _require_eager("TensorFlowKerasState")
        self.backend = backend
        super().__init__(model, optimizer, **kwargs)


class TensorFlowState(VariablesState):
    """The training state of a list of ``tf.Variable``\\ s (and attributes given as keyword arguments).

    ``save`` copies the variables' values to memory, ``restore`` assigns them back, ``sync``
    broadcasts them from rank 0. Horovod's default, ``tf.global_variables()``, does not exist in
    TensorFlow 2, so ``variables`` must be given; ``session`` (TensorFlow 1) is refused.
    """

    def __init__(self, variables: Sequence[tf.Variable] | None = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise NotImplementedError("TensorFlowState(session=...) is TensorFlow 1's graph mode, which hora does "
                                      "not support: run eagerly and pass the tf.Variables to keep")
        _require_eager("TensorFlowState")
        if variables is None:
            raise ValueError("TensorFlowState needs its variables: TensorFlow 2 has no global variable collection "
                             "to default to (pass e.g. model.variables + optimizer.variables)")
        self.variables = list(variables)
        self.session = None
        super().__init__(**kwargs)

    def _variables(self) -> list:
        return list(self.variables)
