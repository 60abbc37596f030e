"""Elastic training for Keras: ``KerasState``, the three state callbacks and ``run``
(horovod.tensorflow.keras.elastic's names).

On the TensorFlow backend ``KerasState`` is a :class:`hora.tensorflow.elastic.TensorFlowKerasState`
and ``run`` is ``hora.tensorflow.elastic.run`` (which also recognises a collective failed inside
``model.fit``'s compiled step), as in Horovod. On the torch backend, where Keras runs the step
eagerly and failures arrive as they are, they are the backend-neutral
:class:`hora.elastic_variables.KerasModelState` and :func:`hora.elastic.run`, and TensorFlow is never
imported.

The callbacks keep ``state.batch`` and ``state.epoch`` current and commit the state while
``model.fit`` runs. Horovod's example lists them in this order, which is the one to use::

    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)

Committing last means each commit already holds that batch's or epoch's counters (an epoch-end
commit saves ``epoch + 1`` and ``batch = 0``). ``epochs=epochs - state.epoch``, without
``initial_epoch``, is how they count: Keras numbers the epochs of each ``fit`` call from 0 and
``UpdateEpochStateCallback`` adds the epoch the state held when that call began.
"""

from __future__ import annotations

from typing import Any

import keras

from hora.elastic import ObjectState, State

if keras.backend.backend() != "tensorflow":
    from hora.elastic import run
    from hora.elastic_variables import KerasModelState as _ModelState
else:  # TensorFlowKerasState is a KerasModelState
    from hora.tensorflow.elastic import TensorFlowKerasState as _ModelState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(_ModelState):
    """A Keras model's weights, its optimizer's variables and picklable attributes, for elastic ``run``.

    ``optimizer`` defaults to ``model.optimizer``; one not built yet is built here (as Keras would on
    its first step) so that commits and syncs cover its slots from the start. Keyword arguments become
    synced attributes: ``KerasState(model, epoch=0, batch=0)`` for the callbacks below.
    """

    def __init__(self, model: keras.Model, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches, and at the end of every epoch.

    Each ``fit`` call counts afresh (every rank starts it at the same point, after the sync), so all
    ranks commit at the same batches: a commit is where a host change interrupts every rank at once.
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be a positive integer, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the index (from 0) of the last batch finished in this epoch; 0 at its end.

    As in Horovod, at each epoch's start ``params["steps"]`` (what callbacks such as the progress bar
    read) becomes ``steps_per_epoch - state.batch``. ``fit`` itself takes its step count from its
    arguments, so an epoch resumed after a reset still runs all its steps: a script that must not
    repeat the batches of a partly done epoch skips them in its own data (from ``state.batch``).
    """

    def __init__(self, state: ObjectState) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.params and self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """At each epoch's end set ``state.epoch`` to the number of epochs done in all: the epoch the state
    held when this ``fit`` call began, plus Keras' epoch (counted from 0 in each call), plus 1."""

    def __init__(self, state: ObjectState) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
