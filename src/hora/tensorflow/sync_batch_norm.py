"""``SyncBatchNormalization``: Keras batch normalisation whose training statistics cover every rank's batch.

With per-rank batches of a few samples, each rank's own mean and variance are noisy and differ across
ranks; the layer instead normalises with the statistics of the union of all ranks' batches, so N
ranks with B samples each behave as one process with an N*B batch (outputs, moving statistics and,
through the allreduce's gradient, the gradients once averaged across ranks).

Each rank reduces, in one Sum allreduce, its sample count, its per-channel sum and its sum of squares
(masked entries excluded). The count makes ranks with different batch sizes weigh by their samples,
where Horovod's layer averages the ranks' means with equal weight (the same when batches are
equal). Inference (``training=False``) uses the moving statistics and sends nothing.
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
