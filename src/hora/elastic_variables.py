"""Elastic states made of variables (TensorFlow's and Keras'): what ``hora.tensorflow.elastic`` and
``hora.keras.elastic`` share.

It sits below both bindings, as :mod:`hora.keras_wrapper` does: ``hora.keras`` must not import
TensorFlow when Keras runs on another backend (torch), and ``hora.tensorflow`` never imports
``hora.keras``. Values travel as NumPy arrays (``tf.Variable`` and every backend's Keras variable
convert to one and ``assign`` from one), so one implementation serves all of them.

- ``save`` (each commit) copies every variable's value into a NumPy array of its own: later steps
  update variables in place and must not alter the commit.
- ``restore`` assigns a fresh copy of each saved value to the variable it was read from: a framework
  may keep the buffer it is given, and the commit must survive any number of restores. Variables
  created after the commit (lazily, by a framework) are left as they are.
- ``sync`` broadcasts every variable from rank 0 in one engine round, then takes the result as the
  commit, as Horovod does: a failure before the next commit then rolls back to the state every rank
  shares, not to this rank's values from before the sync.

Which variables belong to a state is read again at every save and sync (not fixed at construction),
so a state follows ``state.model = other_model`` and variables that appear after construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hora import basics
from hora.binding import batched
from hora.collectives import broadcast_object
from hora.elastic import ObjectState
from hora.keras_wrapper import aggregation_variables, build_now


def _value(variable: Any) -> np.ndarray:
    """A variable's current value: a Keras variable of any backend, or a ``tf.Variable``."""
    return np.asarray(variable)


def _copy(variable: Any) -> np.ndarray:
    return np.array(_value(variable), copy=True)


class VariablesState(ObjectState):
    """An :class:`~hora.elastic.ObjectState` that also keeps the values of some variables.

    Subclasses say which variables in :meth:`_variables`; keyword arguments are picklable attributes,
    kept and synced by ``ObjectState``'s rules (``state.epoch``, ``state.batch``...).
    """

    def __init__(self, **kwargs: Any) -> None:
        self._saved_variables: list[tuple[Any, np.ndarray]] = []
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **kwargs)
        self._save_variables()  # restore() before any commit goes back to the state at construction

    def _variables(self) -> list:
        """The variables this state keeps, in an order every rank shares."""
        raise NotImplementedError

    def _save_variables(self) -> None:
        self._saved_variables = [(variable, _copy(variable)) for variable in self._variables()]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in self._saved_variables:
            variable.assign(np.array(value, copy=True))
        super().restore()

    def sync(self) -> None:
        """Every rank takes rank 0's variables (their current values) and committed attributes."""
        variables = self._variables()
        if variables:
            values = batched.broadcast_arrays([_value(v) for v in variables], 0,
                                              name=basics.next_name("elastic.sync_variables"))
            for variable, value in zip(variables, values):
                variable.assign(value)
        self._save_variables()
        super().sync()


def optimizer_variables(optimizer: Any, trainable_variables: Sequence[Any]) -> list:
    """Every variable of a Keras optimizer, building it first if Keras has not yet.

    A Keras 3 optimizer makes its slots (momenta...) on its first step; before that its
    ``variables`` hold only the step counter and learning rate, so a commit or a sync before the
    first step would miss the slots. Building it now for the model's trainable variables, as Keras
    would, gives the first commit every slot and lets the first sync start every rank from rank 0's.
    Optimizers that cannot be built ahead (Keras 2's ``variables()`` method) are read as they are:
    their slots are zeros when made, from weights every rank shares after the sync, so ranks are
    still equal after the first step, and the next commit or sync covers them.
    """
    if optimizer is None:
        return []
    if hasattr(optimizer, "built") and hasattr(optimizer, "build"):
        build_now(optimizer, trainable_variables)
    variables = optimizer.variables
    if callable(variables):
        variables = variables()
    return list(variables) + aggregation_variables(optimizer)


class KerasModelState(VariablesState):
    """A Keras model's weights, its optimizer's variables and picklable attributes.

    ``model.weights`` (trainable and not: batch-norm statistics included) are kept; the random-seed
    state of dropout layers is not, so ranks keep drawing different masks. ``optimizer`` defaults to
    ``model.optimizer`` (the one ``compile`` was given) and may be None (only the model is kept).
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("the model must be built before its elastic state is made (it has no weights yet): "
                             "call model.build(input_shape), or model(x) on one batch, first")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def _variables(self) -> list:
        return list(self.model.weights) + optimizer_variables(self.optimizer, self.model.trainable_variables)
