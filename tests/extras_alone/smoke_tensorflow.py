"""The tensorflow-cpu extra alone: hora.tensorflow's allreduce, broadcast_variables and one
DistributedGradientTape step on 2 ranks, started by ``hora run -np 2``.

The same arithmetic as smoke_torch.py: rank 0's weights [0.5, -0.25, 1.0] broadcast over rank 1's
zeros, rows of (rank + 1) * [1, 1, 1], local gradients 2.5 and 10.0, averaged 6.25 by the tape, one
SGD step of 0.1 to [-0.125, -0.875, 0.375]. Nothing else gives those numbers on both ranks.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from smoke_report import report  # this folder: on the path of a script run from it

import hora.tensorflow as hvd


def main() -> None:
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank = hvd.rank()
    summed = hvd.allreduce(tf.constant([1.0 + rank, 10.0]), op=hvd.Sum, name="smoke.sum")

    w = tf.Variable([[0.5], [-0.25], [1.0]] if rank == 0 else [[0.0], [0.0], [0.0]])
    hvd.broadcast_variables([w], root_rank=0)
    x = tf.fill((4, 3), float(rank + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
    tape = hvd.DistributedGradientTape(tape)
    (grad,) = tape.gradient(loss, [w])
    w.assign_sub(0.1 * grad)

    report({
        "rank": rank, "size": hvd.size(), "sum": summed.numpy().tolist(),
        "grad": grad.numpy().flatten().tolist(), "weights": w.numpy().flatten().tolist(),
        "tensorflow": tf.__version__,
    })
    hvd.shutdown()


if __name__ == "__main__":
    main()
