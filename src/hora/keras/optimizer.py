"""hora.keras.DistributedOptimizer and load_model: Keras 3 optimizers whose updates use gradients
averaged across ranks, on whichever backend Keras runs.

The wrapper itself is :mod:`hora.keras_wrapper`, which hora.tensorflow uses too. On the TensorFlow
backend the reduction is hora.tensorflow's (one op inside the step Keras compiles); imported here
only then, so hora.keras on the torch backend never imports TensorFlow.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras

from hora import horovod_args
from hora.basics import Average, ProcessSet, global_process_set
from hora.compression import Compression
from hora.keras_wrapper import is_distributed, wrap

if keras.backend.backend() == "tensorflow":
    from hora.tensorflow.gradients import GradientAllreducer as _tensorflow_reducer
else:
    _tensorflow_reducer = None


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: int = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
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
    """
    groups = horovod_args.resolve_groups(num_groups, groups)
    return wrap(optimizer, False, _tensorflow_reducer, name, device_dense, device_sparse, compression, sparse_as_dense,
                gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients, groups,
                process_set, scale_local_gradients)


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None, custom_objects: dict | None = None,
               compression=Compression.none, legacy_opts: bool = False) -> keras.Model:
    """``keras.models.load_model``, with the saved optimizer (and its state) made distributed again.

    ``custom_optimizers`` are optimizer classes the file may name besides Keras' own.
    ``legacy_opts`` is Horovod's switch for Keras 2's ``optimizers.legacy`` classes, which Keras 3
    does not have: only False is accepted.
    """
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
