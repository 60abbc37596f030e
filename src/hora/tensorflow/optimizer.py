"""hora.tensorflow.DistributedOptimizer: horovod.tensorflow's optimizer wrapper on TensorFlow 2.

In TensorFlow 2.16+ ``tf.keras`` is Keras 3, so the optimizers a TensorFlow 2 script uses are
Keras optimizers: they are wrapped by :mod:`hora.keras_wrapper`, as :func:`hora.keras.DistributedOptimizer`
wraps them.
TensorFlow 1 style ``tf.compat.v1.train.Optimizer`` subclasses are wrapped too: their
``compute_gradients`` (and so ``minimize``) returns gradients averaged across ranks, or, with
``backward_passes_per_step`` > 1, aggregated locally first (:mod:`hora.tensorflow.aggregation`),
in a TensorFlow 1 graph, inside ``tf.function`` and eagerly.

``DistributedOptimizer(op=Adasum)`` on a ``tf.compat.v1.train`` optimizer is Horovod's Adasum optimizer for
TensorFlow 1 (in this module, as in Horovod), which reduces weight updates rather than gradients.
``compute_gradients`` (and so ``minimize``) gives this rank's own gradients; ``apply_gradients`` takes the
wrapped optimizer's local step, combines every variable's delta (after minus before) across ranks with
Adasum, and sets the variable to its value before the step plus the combined delta. Variables given to
``register_local_var`` keep their local step. The reads before and after the step are ordered by control
dependencies, for graphs; the tests run it eagerly. ``backward_passes_per_step`` > 1 is refused with Adasum.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hora import basics, horovod_args, keras_wrapper
from hora.basics import Adasum, Average, ProcessSet, global_process_set
from hora.compression import Compression
from hora.tensorflow.aggregation import V1GradientAggregator
from hora.tensorflow.gradients import GradientAllreducer, ReducesGradients, _source_key


class _DistributedV1Optimizer(ReducesGradients):
    """Mixed in before a ``tf.compat.v1.train.Optimizer`` subclass."""

    _hora_aggregator: V1GradientAggregator | None = None

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: it is not reduced (with ``scale_local_gradients``,
        the default, it is divided by the process set's size, as Horovod does)."""
        self._hora_keep_local(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, gradients averaged across ranks."""
        pairs = super().compute_gradients(*args, **kwargs)
        variables = [v for _, v in pairs]
        grads = [g for g, _ in pairs]
        if self._hora_aggregator is not None:
            grads = self._hora_aggregator.compute_gradients(grads, variables)
        else:
            grads = self._hora_reduce(grads, variables)
        return list(zip(grads, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's update; with ``backward_passes_per_step`` > 1 only on the passes that
        reduced (the others advance ``global_step`` alone, as in Horovod)."""
        if self._hora_aggregator is None:
            return super().apply_gradients(grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)
        return self._hora_aggregator.apply_gradients(
            lambda: super(_DistributedV1Optimizer, self).apply_gradients(grads_and_vars, global_step=global_step,
                                                                         name=name),
            [g for g, _ in grads_and_vars], global_step)



class _DistributedAdasumV1Optimizer(_DistributedV1Optimizer):
    """Mixed in before a ``tf.compat.v1.train.Optimizer`` subclass instead of :class:`_DistributedV1Optimizer`."""

    def compute_gradients(self, *args, **kwargs):
        """This rank's own (gradient, variable) pairs: with Adasum the deltas are reduced, not these."""
        return super(_DistributedV1Optimizer, self).compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The local step, then each variable set to its start plus the Adasum of every rank's delta."""
        pairs = list(grads_and_vars)
        local_step = super(_DistributedV1Optimizer, self).apply_gradients
        shared = [v for g, v in pairs if g is not None and _source_key(v) not in self._hora_local]
        starts = [tf.identity(v.read_value()) for v in shared]
        with tf.control_dependencies(starts):
            applied = local_step(pairs, global_step=global_step, name=name)
        with tf.control_dependencies([applied] if applied is not None else []):
            deltas = [v.read_value() - s for v, s in zip(shared, starts)]
        combined = self._hora_allreducer(deltas, shared)
        return tf.group(*[v.assign(s + d) for v, s, d in zip(shared, starts, combined)])


def DistributedOptimizer(optimizer, name: str | None = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True, *, shard_optimizer_state: bool = False):
    """Wrap an optimizer so that it applies gradients averaged across all ranks.

    A Keras optimizer (``tf.keras.optimizers.*``) gets :func:`hora.keras.DistributedOptimizer`
    with the same arguments; ``use_locking`` is TensorFlow 1's and has no effect.
    ``optimizer.register_local_var(variable)`` keeps that variable's gradient on each rank,
    unreduced; with ``scale_local_gradients`` (the default) it is divided by the process set's size,
    as in Horovod. A ``tf.compat.v1.train`` optimizer with ``backward_passes_per_step`` k > 1 sums
    its gradients locally over k ``compute_gradients`` calls and reduces and applies them on the
    k-th, in a graph and eagerly (Horovod: graph only). ``shard_optimizer_state=True`` is refused:
    sharded optimizer state is built for hora.torch and hora.jax only.
    """
    keras_wrapper.refuse_sharded_state(shard_optimizer_state)
    groups = horovod_args.resolve_groups(num_groups, groups)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return keras_wrapper.wrap(
            optimizer, False, GradientAllreducer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups, process_set=process_set,
            scale_local_gradients=scale_local_gradients)
    if keras_wrapper.uses_tf_keras() and not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        from hora.tensorflow import keras2

        if keras2.is_optimizer(optimizer):  # Keras 2 (TF_USE_LEGACY_KERAS=1): Horovod's Keras 2 wrapper
            return keras2.wrap(optimizer, False, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, groups, process_set, scale_local_gradients)
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer (tf.keras.optimizers.*) or a "
                        f"tf.compat.v1.train.Optimizer, got {type(optimizer).__module__}.{type(optimizer).__name__}")
    passes = horovod_args.backward_passes(backward_passes_per_step)
    basics.engine()  # fail early, with the init() message, when hora is not initialised
    base = type(optimizer)
    prefix = name if name is not None else f"Distributed{base.__name__}"
    mixin = _DistributedV1Optimizer
    if horovod_args.resolve_op(op) == Adasum:  # Horovod's Adasum optimizer: the deltas of a local step
        if passes > 1:
            raise ValueError("op=Adasum with a tf.compat.v1 optimizer takes backward_passes_per_step=1 in hora "
                             "(accumulate gradients yourself before apply_gradients)")
        mixin = _DistributedAdasumV1Optimizer
    cls: type[object] = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    wrapped: Any = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hora_bind(GradientAllreducer(prefix, device_dense, device_sparse, compression, sparse_as_dense, op,
                                          gradient_predivide_factor, groups, process_set),
                       set(), scale_local_gradients, process_set)
    if passes > 1:
        wrapped._hora_aggregator = V1GradientAggregator(passes, average_aggregated_gradients, sparse_as_dense,
                                                        wrapped._hora_reduce, prefix)
    return wrapped
