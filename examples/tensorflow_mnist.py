"""TensorFlow 1 style training of a small convolutional network on handwritten digits with hora.

The shape of Horovod's ``tensorflow_mnist`` example, in a plain ``tf.compat.v1`` graph: a
``MonitoredTrainingSession`` with ``BroadcastGlobalVariablesHook`` and ``StopAtStepHook``, a
``tf.compat.v1.train`` optimizer wrapped by ``DistributedOptimizer``, and a ``feed_dict`` per step.
It needs no download: the digits are scikit-learn's bundled set (1797 scans, 8x8 pixels), split
80/20 into training and test images as in the other examples. Run:

    hora run -np 2 python examples/tensorflow_mnist.py

Each training step's one ``session.run`` evaluates several collectives at once: the allreduce of
every gradient (inside the optimizer's ``minimize``) and the allreduces of the loss and accuracy it
logs. TensorFlow's executor runs them in whatever order their inputs become ready, which differs
between workers; hora names each collective when the graph is built, so the order does not matter.
At the end, a session hook evaluates the test set, each worker its shard, and sums the correct
answers over the workers.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter, before it loads

import numpy as np
import tensorflow as tf
from tensorflow2_keras_mnist import digits_arrays  # the same data as the Keras examples

import hora.tensorflow as hvd

v1 = tf.compat.v1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, metavar="N",
                        help="input batch size for training, per worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train (default: 10)")
    parser.add_argument("--lr", type=float, default=0.001, metavar="LR",
                        help="Adam learning rate of one worker; scaled by the number of workers (default: 0.001)")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="rank 0 writes checkpoints here, as in Horovod's example (default: none)")
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="CPU threads per worker (default: the host's cores divided among its workers)")
    parser.add_argument("--log-every", type=int, default=50, metavar="N",
                        help="rank 0 prints the averaged loss and accuracy every N steps (default: 50)")
    return parser.parse_args(argv)


def conv_model(images: tf.Tensor) -> tf.Tensor:
    """Two 3x3 convolutions, one 2x2 max-pool and two dense layers, in raw TF1 variables and ops."""
    init = v1.glorot_uniform_initializer()

    def weights(name: str, shape: list[int]) -> tuple[tf.Variable, tf.Variable]:
        return (v1.get_variable(f"{name}/kernel", shape, initializer=init),
                v1.get_variable(f"{name}/bias", shape[-1:], initializer=v1.zeros_initializer()))

    w1, b1 = weights("conv1", [3, 3, 1, 16])
    w2, b2 = weights("conv2", [3, 3, 16, 32])
    w3, b3 = weights("dense1", [4 * 4 * 32, 64])
    w4, b4 = weights("dense2", [64, 10])
    h = tf.nn.relu(tf.nn.conv2d(images, w1, strides=1, padding="SAME") + b1)
    h = tf.nn.relu(tf.nn.conv2d(h, w2, strides=1, padding="SAME") + b2)
    h = tf.nn.max_pool2d(h, 2, 2, padding="VALID")
    h = tf.nn.relu(tf.matmul(tf.reshape(h, [-1, 4 * 4 * 32]), w3) + b3)
    return tf.matmul(h, w4) + b4


class TestSetHook(v1.train.SessionRunHook):
    """At the end of training, every worker counts its test shard's correct answers; the sum over
    the workers is the accuracy on the whole test set."""

    def __init__(self, correct: tf.Tensor, feed: dict) -> None:
        self.correct = correct
        self.feed = feed
        self.accuracy: float | None = None

    def end(self, session) -> None:
        correct, count = session.run(self.correct, self.feed)
        self.accuracy = float(correct) / float(count)


def main(argv=None) -> float:
    args = parse_args(argv)
    started = time.perf_counter()
    v1.disable_eager_execution()
    hvd.init()
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    config = v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=max(2, threads))
    v1.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast aligns the weights

    train_x, train_y, test_x, test_y = digits_arrays()
    # Each worker takes every size()-th training image; every worker runs the same number of steps.
    shard_x, shard_y = train_x[hvd.rank()::hvd.size()], train_y[hvd.rank()::hvd.size()]
    steps_per_epoch = max(1, len(train_x) // hvd.size() // args.batch_size)
    last_step = steps_per_epoch * args.epochs

    images = v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    logits = conv_model(images)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    hits = tf.cast(tf.equal(tf.argmax(logits, axis=1), labels), tf.float32)
    global_step = v1.train.get_or_create_global_step()

    # The global batch is size() times the per-worker batch: scale the learning rate with it.
    optimizer = hvd.DistributedOptimizer(v1.train.AdamOptimizer(args.lr * hvd.size()))
    train_op = optimizer.minimize(loss, global_step=global_step)
    # Logged with every step, in the same session.run as the training op.
    mean_loss = hvd.allreduce(loss)
    mean_accuracy = hvd.allreduce(tf.reduce_mean(hits))
    # The test set: the number of correct answers and of images, summed over the workers.
    correct = hvd.allreduce(tf.stack([tf.reduce_sum(hits), tf.cast(tf.size(hits), tf.float32)]), op=hvd.Sum)
    test_hook = TestSetHook(correct, {images: test_x[hvd.rank()::hvd.size()], labels: test_y[hvd.rank()::hvd.size()]})

    hooks = [
        # Every worker starts from rank 0's initial variables (or its restored checkpoint).
        hvd.BroadcastGlobalVariablesHook(0),
        v1.train.StopAtStepHook(last_step=last_step),
        test_hook,
    ]
    # Only rank 0 writes checkpoints, so that the workers do not corrupt each other's.
    checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None
    rng = np.random.default_rng(args.seed + hvd.rank())
    order = rng.permutation(len(shard_x))
    position = 0
    with v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks, config=config,
                                           save_summaries_steps=None, save_summaries_secs=None,
                                           log_step_count_steps=None) as session:
        while not session.should_stop():
            if position + args.batch_size > len(order):
                order, position = rng.permutation(len(shard_x)), 0
            batch = order[position:position + args.batch_size]
            position += args.batch_size
            step, _, step_loss, step_accuracy = session.run(
                [global_step, train_op, mean_loss, mean_accuracy], {images: shard_x[batch], labels: shard_y[batch]})
            if hvd.rank() == 0 and (step + 1) % args.log_every == 0:
                print(f"step {step + 1}/{last_step}: loss {step_loss:.4f}, accuracy {step_accuracy:.4f}", flush=True)

    accuracy = test_hook.accuracy
    if hvd.rank() == 0:
        print(f"Final test accuracy: {100.0 * accuracy:.2f}% after {args.epochs} epoch(s) ({last_step} steps)",
              flush=True)
        print(f"Done in {time.perf_counter() - started:.1f} s on {hvd.size()} worker(s), {threads} thread(s) each",
              flush=True)
    return accuracy


if __name__ == "__main__":
    main()
