"""``SyncBatchNormalization``: Keras batch normalisation whose training statistics cover every rank's batch.

With per-rank batches of a few samples, each rank's own mean and variance are noisy and differ across
ranks; the layer instead normalises with the statistics of the union of all ranks' batches, so N
ranks with B samples each behave as one process with an N*B batch (outputs, moving statistics and,
through the allreduce's gradient, the gradients once averaged across ranks).

Each rank reduces, in one Sum allreduce, its sample count, its per-channel sum and its sum of squares
(masked entries excluded). The count makes ranks with different batch sizes weigh by their samples,
where Horovod's layer averages the ranks' means with equal weight (the same when batches are
equal). Inference (``training=False``) uses the moving statistics and sends nothing.

In a TensorFlow 1 graph the moving statistics' assignments are ops nothing runs by itself: as
Horovod does, the layer adds them to ``tf.compat.v1.GraphKeys.UPDATE_OPS``, for the usual
``with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS))`` around the train op.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hora import basics
from hora.basics import Sum, global_process_set
from hora.tensorflow.mpi_ops import allreduce


@keras.saving.register_keras_serializable(package="hora")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalisation with statistics synchronised across all ranks while training.

    Takes ``keras.layers.BatchNormalization``'s arguments. ``fused`` is Keras 2's; as in Horovod only
    ``fused=False`` is accepted (Keras 3 has no fused kernel to turn off).
    """

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True (or None, which may fuse)")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization synchronises through hora; synchronized=True (Keras' own, "
                             "for tf.distribute strategies) cannot be combined with it")
        kwargs.pop("synchronized", None)
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if tf.executing_eagerly() or tf.inside_function():
            return super().call(inputs, training=training, mask=mask)
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        outputs = super().call(inputs, training=training, mask=mask)
        moving = {_graph_ref(v) for v in (self.moving_mean, self.moving_variance)}
        for op in graph.get_operations()[first:]:
            if op.type in ("Assign", "AssignVariableOp") and op.inputs and op.inputs[0].ref() in moving:
                graph.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, op)
        return outputs

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if basics.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.convert_to_tensor(inputs)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), x.dtype), tf.shape(x))
        count = tf.reduce_sum(weights, axis=axes, keepdims=True)
        total = tf.reduce_sum(x * weights, axis=axes, keepdims=True)
        squares = tf.reduce_sum(tf.square(x) * weights, axis=axes, keepdims=True)
        # one allreduce for the three; its gradient (a Sum of the upstream gradients) makes the
        # averaged gradients those of the union batch
        stacked = allreduce(tf.stack([count, total, squares]), op=Sum, process_set=global_process_set)
        count, total, squares = tf.unstack(stacked)
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), 0.0)
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes)


def _graph_ref(variable: Any) -> Any:
    """The graph tensor an assignment to this Keras variable writes through (handle or ref)."""
    inner = getattr(variable, "value", variable)
    inner = getattr(inner, "_variable", inner)  # an autocast wrapper
    handle = getattr(inner, "handle", None)
    target = handle if handle is not None else inner._ref()
    return target.ref()
