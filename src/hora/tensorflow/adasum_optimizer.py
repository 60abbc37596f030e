"""hora.tensorflow.DistributedOptimizer(op=Adasum) on a ``tf.compat.v1.train`` optimizer: Horovod's Adasum
optimizer for TensorFlow 1, which reduces weight updates rather than gradients.

``compute_gradients`` (and so ``minimize``) gives this rank's own gradients; ``apply_gradients`` takes the
wrapped optimizer's local step, combines every variable's delta (after minus before) across ranks with
Adasum, and sets the variable to its value before the step plus the combined delta. Variables given to
``register_local_var`` keep their local step. The reads before and after the step are ordered by control
dependencies, for graphs; the tests run it eagerly. ``backward_passes_per_step`` > 1 is refused with Adasum.
"""

from __future__ import annotations

import tensorflow as tf

from hora.tensorflow.gradients import _source_key
from hora.tensorflow.optimizer import _DistributedV1Optimizer


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
