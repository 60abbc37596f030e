"""hora.keras.DistributedOptimizer, PartialDistributedOptimizer and load_model: optimizers whose
updates use gradients averaged across ranks, on whichever backend Keras runs, and for Keras 2.

The Keras 3 wrapper is :mod:`hora.keras_wrapper`, which hora.tensorflow uses too; under
``TF_USE_LEGACY_KERAS=1`` (see :func:`hora.keras_wrapper.uses_tf_keras`) tf_keras optimizers are
wrapped by :mod:`hora.tensorflow.keras2`. On the TensorFlow backend the reduction is hora.tensorflow's
(one op inside the step Keras compiles, dense gradients in flat buckets, one engine request each);
imported here only then, so hora.keras on the torch backend never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras

from hora import horovod_args
from hora.basics import Average, ProcessSet, global_process_set
from hora.compression import Compression
from hora.keras_wrapper import Reducer, is_distributed, keras_api, refuse_sharded_state, uses_tf_keras, wrap

_tensorflow_reducer: Callable[..., Reducer] | None = None
if keras.backend.backend() == "tensorflow":
    from hora.tensorflow.gradients import GradientAllreducer as _tensorflow_reducer


def _keras2() -> Any:
    """:mod:`hora.tensorflow.keras2`, imported only in processes that run Keras 2."""
    from hora.tensorflow import keras2
    return keras2


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: int = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True, *,
                         shard_optimizer_state: bool = False) -> keras.optimizers.Optimizer:
    """Wrap a Keras optimizer so that its updates use gradients averaged across all ranks.

    The result is an instance of the wrapped optimizer's own class (``isinstance`` checks, saving
    and ``get_config`` behave as for the original), sharing its variables and hyper-parameters.
    ``name`` prefixes the names of the reductions (default ``Distributed<Class>``); the optimizer's
    own Keras name is kept, so its variables save and load under the same paths. ``groups`` (or the
    deprecated ``num_groups``) is an int or lists of variables, each group reduced as one unit. On
    the TensorFlow backend, compile the model with ``jit_compile=False`` (the default on CPU): XLA
    cannot host hora's Python-side collectives. ``optimizer.register_local_var(variable)`` keeps that
    variable's gradient on each rank, unreduced; with ``scale_local_gradients`` (the default) it is
    divided by the process set's size, as in Horovod.

    Under ``TF_USE_LEGACY_KERAS=1`` it wraps tf_keras optimizers (``tf_keras.optimizers.*`` and
    ``tf_keras.optimizers.legacy.*``, ``lr=`` included) the way Horovod's Keras 2 wrapper does: see
    :mod:`hora.tensorflow.keras2`. ``shard_optimizer_state=True`` is refused: sharded optimizer state
    is built for hora.torch and hora.jax only.
    """
    refuse_sharded_state(shard_optimizer_state)
    groups = horovod_args.resolve_groups(num_groups, groups)
    if uses_tf_keras() and not isinstance(optimizer, keras.optimizers.Optimizer):
        return _keras2().wrap(optimizer, False, name, device_dense, device_sparse, compression, sparse_as_dense,
                              gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
                              groups, process_set, scale_local_gradients)
    return wrap(optimizer, False, _tensorflow_reducer, name, device_dense, device_sparse, compression, sparse_as_dense,
                gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients, groups,
                process_set, scale_local_gradients)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                groups: Any = None, process_set: ProcessSet = global_process_set,
                                local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
    """A :func:`DistributedOptimizer` that keeps the gradients of ``local_layers`` on each rank.

    ``local_layers``: a Keras layer or a collection of them whose trainable weights each rank trains
    on its own (a per-rank head, say): their gradients are not reduced, and with
    ``scale_local_gradients`` (the default) are divided by the process set's size, as in Horovod.
    Keep them out of ``BroadcastGlobalVariablesCallback`` with its ``local_variables`` if each rank
    must also start them from its own values.
    """
    layer_type = keras_api().layers.Layer
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, layer_type):
        local_layers = [local_layers]
    else:
        local_layers = list(local_layers)
        wrong = [type(layer).__name__ for layer in local_layers if not isinstance(layer, layer_type)]
        if wrong:
            raise ValueError(f"local_layers must be {layer_type.__module__.split('.')[0]} layers; "
                             f"got {', '.join(wrong)}")
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, backward_passes_per_step,
                                   average_aggregated_gradients, groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for weight in layer.trainable_weights:
            wrapped.register_local_var(weight)
    return wrapped


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None, custom_objects: dict | None = None,
               compression=Compression.none, legacy_opts: bool = False) -> keras.Model:
    """``keras.models.load_model``, with the saved optimizer (and its state) made distributed again.

    ``custom_optimizers`` are optimizer classes the file may name besides Keras' own.
    ``legacy_opts`` is Horovod's switch for Keras 2's ``optimizers.legacy`` classes: under
    ``TF_USE_LEGACY_KERAS=1`` the saved optimizer is rebuilt as its ``tf_keras.optimizers.legacy``
    class; Keras 3 has no such classes, so there only False is accepted.
    """
    if uses_tf_keras():
        return _load_keras2_model(filepath, custom_optimizers, custom_objects, compression, legacy_opts)
    if legacy_opts:
        raise ValueError("legacy_opts=True asks for Keras 2's optimizers.legacy classes, which Keras 3 removed; "
                         "load the model with legacy_opts=False")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and not is_distributed(optimizer):
        wrap(optimizer, True, _tensorflow_reducer, compression=compression)
    return model


def _load_keras2_model(filepath: str, custom_optimizers: Sequence[type] | None, custom_objects: dict | None,
                       compression, legacy_opts: bool) -> Any:
    """tf_keras' ``load_model``, the optimizer rebuilt (as its legacy class with ``legacy_opts``) and wrapped."""
    keras2 = _keras2()
    objects = dict(keras2.legacy_classes()) if legacy_opts else {}
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    objects.update(custom_objects or {})
    model = keras_api().models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if keras2.is_optimizer(optimizer) and not keras2.is_distributed(optimizer):
        keras2.wrap(optimizer, True, compression=compression)
    return model
