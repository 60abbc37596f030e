"""Data-parallel training on handwritten digits with a custom TensorFlow 2 loop and DistributedGradientTape.

The counterpart of Horovod's ``tensorflow2_mnist`` example (a ``tf.function`` training step around
``hvd.DistributedGradientTape``, variables broadcast after the first step), on the digits data and
the network of ``examples/tensorflow2_keras_mnist.py`` (no download). Run it with:

    hora run -np 2 python examples/tensorflow2_mnist.py

What makes it distributed: each worker draws batches from its own shard of the training images;
the tape's ``gradient()`` averages the gradients across workers (inside the compiled step); the
learning rate is scaled by the number of workers; after the first step every replica takes rank 0's
weights and optimizer state with ``hvd.broadcast_variables``; the test accuracy is averaged with
``hvd.allreduce``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter, before it loads

import numpy as np
import tensorflow as tf
from tensorflow2_keras_mnist import build_model, digits_arrays  # same data and network

import hora.tensorflow as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, metavar="N",
                        help="input batch size for training, per worker (default: 32)")
    parser.add_argument("--steps", type=int, default=400, metavar="N",
                        help="training steps in all, shared among the workers (default: 400; Horovod's "
                             "example takes 10000 // size() steps of MNIST)")
    parser.add_argument("--lr", type=float, default=0.001, metavar="LR",
                        help="Adam learning rate of one worker; scaled by the number of workers (default: 0.001)")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                        help="how many steps to wait before logging training status (default: 10)")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="rank 0 saves a tf.train.Checkpoint here at the end (default: none)")
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="CPU threads per worker (default: the host's cores divided among its workers)")
    parser.add_argument("--data-dir", default=None,
                        help="accepted for compatibility with Horovod's example; the digits ship with "
                             "scikit-learn, so nothing is read from or written to it")
    return parser.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    started = time.perf_counter()
    hvd.init()
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    tf.keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast aligns them

    train_x, train_y, test_x, test_y = digits_arrays()
    dataset = tf.data.Dataset.from_tensor_slices((train_x[hvd.rank()::hvd.size()], train_y[hvd.rank()::hvd.size()]))
    dataset = dataset.repeat().shuffle(1000, seed=args.seed + hvd.rank()).batch(args.batch_size)

    model = build_model()
    loss = tf.keras.losses.SparseCategoricalCrossentropy()
    # The global batch is size() times the per-worker batch: scale the learning rate with it.
    opt = tf.keras.optimizers.Adam(args.lr * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            loss_value = loss(labels, probs)
        # Averages the gradients across workers.
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # After the first step (which builds the optimizer's variables), every replica takes rank 0's
        # weights and optimizer state. (Keras 3: ``opt.variables`` is a list, not a method;
        # ``model.weights`` leaves the dropout seeds apart, so masks still differ between workers.)
        if first_batch:
            hvd.broadcast_variables(model.weights, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss_value

    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} worker(s) ({threads} thread(s) each): {len(train_x)} training and "
              f"{len(test_x)} test images of 8x8 digits", flush=True)
    # Horovod's example takes 10000 // size() steps: the total work is shared among the workers.
    for batch, (images, labels) in enumerate(dataset.take(args.steps // hvd.size())):
        loss_value = training_step(images, labels, batch == 0)
        if batch % args.log_interval == 0 and hvd.local_rank() == 0:
            print(f"Step #{batch}\tLoss: {float(loss_value):.6f}", flush=True)

    probs = model(test_x[hvd.rank()::hvd.size()], training=False)
    correct = np.mean(np.argmax(probs, axis=1) == test_y[hvd.rank()::hvd.size()])
    accuracy = float(hvd.allreduce(tf.constant(correct, tf.float64), name="avg_accuracy"))
    if hvd.rank() == 0:
        if args.checkpoint_dir:
            tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(args.checkpoint_dir, "ckpt"))
        print(f"Final test accuracy: {100.0 * accuracy:.2f}% after {args.steps // hvd.size()} step(s) per worker "
              f"in {time.perf_counter() - started:.1f} s", flush=True)
    hvd.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
