"""Keras callbacks for data-parallel training, with horovod.tensorflow.keras.callbacks' names and arguments.

They run in Python between steps, so they work on every Keras backend hora supports: values go
through NumPy and hora's collectives. ``device`` arguments are accepted for Horovod compatibility
and place nothing (hora reduces in host memory). Under ``TF_USE_LEGACY_KERAS=1`` they are Keras 2
(tf_keras) callbacks, built on the Keras this process uses (:func:`hora.keras_wrapper.keras_api`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hora import basics, collectives
from hora.basics import Average
from hora.binding import batched
from hora.keras_wrapper import build_now, keras_api, to_numpy, uses_tf_keras

if TYPE_CHECKING:  # tf_keras has the same API
    import keras
else:
    keras = keras_api()  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1: the callbacks' base classes
logger = logging.getLogger(__name__)
_value = to_numpy


def _optimizer_state(optimizer: Any, trainable: Sequence[Any]) -> list:
    """The optimizer's variables (slots built now if Keras has not made them yet), or [] for none."""
    if uses_tf_keras():
        from hora.tensorflow import keras2
        if not keras2.is_optimizer(optimizer):
            return []
        keras2.build(optimizer, trainable)
        return keras2.variables(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return []
    # Keras builds it lazily on the first step; building now lets the first step already start
    # from the root's state.
    build_now(optimizer, trainable)
    return list(optimizer.variables)


def broadcast_model_state(model: keras.Model, root_rank: int, local_variables: Sequence[Any] = ()) -> None:
    """Give every rank ``root_rank``'s weights and optimizer state (building the optimizer first).

    ``model.weights`` are the trainable and non-trainable weights (batch-norm statistics included);
    random-seed state is left alone, so dropout masks still differ between ranks.
    ``local_variables`` keep each rank's own values.
    """
    variables = list(model.weights) + _optimizer_state(getattr(model, "optimizer", None), model.trainable_variables)
    if local_variables:
        local = {id(v) for v in local_variables}
        variables = [v for v in variables if id(v) not in local]
    values = batched.broadcast_arrays([_value(v) for v in variables], root_rank,
                                      name=basics.next_name("broadcast_global_variables"))
    for variable, value in zip(variables, values):
        variable.assign(value)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from ``root_rank``'s weights and optimizer state.

    Horovod broadcasts after the first batch (when Keras 2 had made the optimizer's slots); hora
    does it before the first batch, building the optimizer if needed, so the very first update
    already starts from identical replicas. A model whose weights do not exist yet at that point
    (a subclassed model built by its first call) is broadcast after the first batch instead.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        """``local_variables``: a variable or a collection of them that each rank keeps as it is."""
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        if local_variables is None:
            local_variables = []
        elif hasattr(local_variables, "assign"):  # one variable
            local_variables = [local_variables]
        else:
            local_variables = list(local_variables)
            if not all(hasattr(v, "assign") for v in local_variables):
                raise ValueError("local_variables must be a variable (of model.weights or the optimizer's) "
                                 "or a collection of them")
        self.local_variables = local_variables
        self.broadcast_done = False

    def _broadcast(self) -> None:
        broadcast_model_state(self.model, self.root_rank, self.local_variables)
        self.broadcast_done = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.broadcast_done and self.model.weights:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace every logged metric with its average over all ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping, learning-rate
    schedules on plateaus) so they see the averages; every rank must log the same metric names.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def _average_metrics_in_place(self, logs: dict | None) -> None:
        if not logs:
            return
        names = sorted(logs)  # the same order on every rank
        handles = [collectives.allreduce_async(np.asarray(_value(logs[n]), dtype=np.float64), op=Average,
                                               name=f"metric_average.{n}") for n in names]
        for name, handle in zip(names, handles):
            logs[name] = float(handle.wait())

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._average_metrics_in_place(logs)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until ``end_epoch``.

    ``multiplier`` is a function of the epoch, or a number m meaning exponential decay:
    ``initial_lr * m ** (epoch - start_epoch)``. With ``staircase`` the rate changes at
    the first batch of each epoch; otherwise at every batch, ``epoch`` then being fractional
    (``epoch + batch / steps_per_epoch``; ``steps_per_epoch`` defaults to what ``fit`` reports).
    ``momentum_correction`` (Goyal et al., 2017) keeps a momentum optimizer's step consistent when
    the rate changes: Horovod scales ``momentum`` by new_lr / old_lr for that batch. Keras 3 keeps
    momentum as a Python float baked into the compiled step, so hora applies the equivalent update
    instead: it scales the optimizer's momentum buffers by new_lr / old_lr (exactly Horovod's
    result for SGD and RMSprop; optimizers without momentum buffers are left alone).
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:  # a number is exponential decay from start_epoch, as in Horovod
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self) -> int:
        steps = (self.params or {}).get("steps")
        if steps:
            return int(steps)
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                         f"parameter to the {type(self).__name__}() (or pass steps_per_epoch to fit).")

    def _learning_rate(self) -> float:
        return float(_value(self.model.optimizer.learning_rate))

    def _adjust_learning_rate(self, epoch: float) -> None:
        # Keras's JAX trainer keeps the training state outside the variables within an epoch: attach
        # it first, so that the rate and momentum buffers read here are current and what is written
        # here is what the next step starts from (the trainer re-reads the state after a sync).
        getattr(self.model, "jax_state_sync", lambda: None)()
        optimizer = self.model.optimizer
        old_lr = self._learning_rate()
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and old_lr and new_lr != old_lr:
            buffers = _momentum_buffers(optimizer)
            if not buffers:
                logger.debug("momentum correction: %s has no momentum buffers to scale", type(optimizer).__name__)
            for buffer in buffers:
                buffer.assign(buffer * (new_lr / old_lr))

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        epoch = self.current_epoch
        assert epoch is not None, "on_epoch_begin comes first"
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            assert self.steps_per_epoch is not None, "on_train_begin sets it"
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = self._learning_rate()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` up to ``initial_lr`` over ``warmup_epochs``.

    Large global batches train badly from the first step at the full scaled rate (Goyal et al.,
    2017); the rate grows linearly per batch and reaches ``initial_lr`` at the end of the last warm-up
    epoch. ``verbose`` prints a line on rank 0 when the warm-up ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # counted at the end of each batch, so that the last batch of an epoch lands on a round value
            assert self.steps_per_epoch is not None, "on_train_begin sets it (staircase=False)"
            epoch += 1.0 / self.steps_per_epoch
            size = basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        end_epoch = self.end_epoch  # warmup_epochs
        if end_epoch is not None and epoch == end_epoch - 1 and self.verbose > 0 and basics.rank() == 0:
            # verbose asks for a line on stdout, as Keras' own callbacks print theirs
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self._learning_rate():g}.")


def _momentum_buffers(optimizer: Any) -> list:
    """The velocity variables of a momentum optimizer (SGD's ``momentums``, RMSprop's ``_momentums``)."""
    if uses_tf_keras():
        from hora.tensorflow import keras2
        return keras2.momentum_buffers(optimizer)
    if not getattr(optimizer, "momentum", 0):
        return []
    for attribute in ("momentums", "_momentums"):
        buffers = getattr(optimizer, attribute, None)
        if buffers:
            return [b for b in buffers if b is not None]
    return []


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model whenever the monitored metric improves, on rank 0 only (Horovod's callback).

    ``ModelCheckpoint`` with ``save_best_only=True`` and whole models. Horovod leaves ``filepath`` to
    be set later (its Spark estimators assign ``callback.filepath``); hora also takes it as a keyword,
    and refuses to train with none set rather than save to a placeholder. Ranks other than 0 write
    nothing, so ranks sharing a file system do not race on one file; put ``MetricAverageCallback``
    before it so rank 0 decides on the average over all ranks.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto", save_freq: Any = "epoch",
                 *, filepath: str | None = None) -> None:
        # Keras checks the path's suffix when it is made; a path set later is checked at train begin
        super().__init__(filepath=filepath or "best.keras", monitor=monitor,
                         verbose=verbose, save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.filepath:
            raise ValueError(f"BestModelCheckpoint on rank {basics.rank()} has no filepath: pass "
                             f"filepath=... or set callback.filepath before model.fit")
        super().on_train_begin(logs)

    def _save_model(self, *args: Any, **kwargs: Any) -> None:
        if basics.rank() == 0:
            super()._save_model(*args, **kwargs)


__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "broadcast_model_state"]
