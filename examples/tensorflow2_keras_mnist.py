"""Data-parallel training of a small convolutional network on handwritten digits with Keras 3 and hora.keras.

The script follows the shape of Horovod's ``tensorflow2_keras_mnist`` example (``model.fit`` with
Horovod's callbacks) but needs no download: the digits are scikit-learn's bundled set (1797 scans,
8x8 pixels), split 80/20 into training and test images as in ``examples/pytorch_mnist.py``. Run:

    hora run -np 2 python examples/tensorflow2_keras_mnist.py

What makes it distributed, step by step:
1. ``hvd.init()``, then each worker limits its CPU threads so the workers do not fight for cores;
2. each worker trains on its own shard of the training images (every size()-th one);
3. the learning rate is multiplied by the number of workers, and ``LearningRateWarmupCallback``
   ramps it up to that value over the first epochs;
4. ``DistributedOptimizer`` averages gradients across workers inside Keras' compiled train step;
5. ``BroadcastGlobalVariablesCallback(0)`` starts every replica from rank 0's weights;
6. ``MetricAverageCallback`` averages the logged metrics, and the test accuracy is averaged with
   ``hvd.allreduce`` before rank 0 prints it.

The Keras backend is whatever Keras was imported with: TensorFlow by default, or torch with
``KERAS_BACKEND=torch``. On a GPU machine keep ``jit_compile=False`` (set below): XLA cannot host
hora's collectives.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter, before it loads

import keras
import numpy as np
from sklearn.datasets import load_digits

import hora.keras as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, metavar="N",
                        help="input batch size for training, per worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train (default: 10)")
    parser.add_argument("--lr", type=float, default=0.001, metavar="LR",
                        help="Adam learning rate of one worker; scaled by the number of workers (default: 0.001)")
    parser.add_argument("--warmup-epochs", type=int, default=3, metavar="N",
                        help="epochs over which the learning rate ramps up to the scaled rate (default: 3)")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--use-mixed-precision", action="store_true", default=False,
                        help="use mixed precision (mixed_float16) for training")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="rank 0 saves a checkpoint per epoch here (default: no checkpoints)")
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="CPU threads per worker (default: the host's cores divided among its workers)")
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2),
                        help="Keras verbosity on rank 0: 1 progress bars, 2 one line per epoch (default: 2)")
    parser.add_argument("--data-dir", default=None,
                        help="accepted for compatibility with Horovod's example; the digits ship with "
                             "scikit-learn, so nothing is read from or written to it")
    return parser.parse_args(argv)


def digits_arrays(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits as (8, 8, 1) float images, normalised, split 80/20 (the same on every worker)."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., np.newaxis]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    split = int(0.8 * len(labels))
    train_idx, test_idx = order[:split], order[split:]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]


def build_model(dropout: bool = True) -> keras.Model:
    """Two 3x3 convolutions, one 2x2 max-pool and two dense layers, sized for 8x8 inputs."""
    layers = [
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Dropout(0.1 if dropout else 0.0),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.25 if dropout else 0.0),
        keras.layers.Dense(10, activation="softmax", dtype="float32"),
    ]
    return keras.Sequential(layers)


def limit_threads(num_threads: int | None) -> int:
    """Share the host's cores among the workers on it (TensorFlow backend; torch reads OMP settings)."""
    threads = num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    elif keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(threads)
    return threads


def main(argv=None) -> float:
    args = parse_args(argv)
    started = time.perf_counter()
    hvd.init()
    threads = limit_threads(args.num_threads)
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast aligns them
    if args.use_mixed_precision:
        # Before the model and the optimizer: DistributedOptimizer built under mixed_float16 holds
        # its LossScaleOptimizer inside, so the overflow check sees the averaged gradients and every
        # worker skips the same steps (compile then leaves it as it is).
        keras.mixed_precision.set_global_policy("mixed_float16")

    train_x, train_y, test_x, test_y = digits_arrays()
    # Each worker takes every size()-th example: its shard of the training and test sets. Every
    # worker must run the same number of steps (each step is a collective), so the shards are cut
    # to the same whole number of batches.
    steps_per_epoch = max(1, len(train_x) // hvd.size() // args.batch_size)
    rows = steps_per_epoch * args.batch_size
    shard_x, shard_y = train_x[hvd.rank()::hvd.size()][:rows], train_y[hvd.rank()::hvd.size()][:rows]

    model = build_model()
    # The global batch is size() times the per-worker batch: scale the learning rate with it.
    scaled_lr = args.lr * hvd.size()
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr), compression=compression)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=optimizer, metrics=["accuracy"],
                  jit_compile=False)

    callbacks = [
        # Every replica starts from rank 0's weights and optimizer state.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Logged metrics become averages over the workers (before other callbacks read them).
        hvd.callbacks.MetricAverageCallback(),
        # Start at scaled_lr / size() and reach scaled_lr after warmup_epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs,
                                                 steps_per_epoch=steps_per_epoch, verbose=1 if hvd.rank() == 0 else 0),
    ]
    if hvd.rank() == 0 and args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} worker(s) (Keras {keras.__version__}, {keras.backend.backend()} backend, "
              f"{threads} thread(s) each): {len(train_x)} training and {len(test_x)} test images of 8x8 digits",
              flush=True)
    model.fit(shard_x, shard_y, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              verbose=args.verbose if hvd.rank() == 0 else 0)

    # Each worker scores its shard of the test set; the averages over workers are the test metrics.
    test_loss, test_accuracy = model.evaluate(test_x[hvd.rank()::hvd.size()], test_y[hvd.rank()::hvd.size()],
                                              verbose=0)
    test_loss = float(hvd.allreduce(test_loss, name="avg_loss"))
    test_accuracy = float(hvd.allreduce(test_accuracy, name="avg_accuracy"))
    weights_agree = hvd.allgather_object(float(sum(np.sum(w) for w in model.get_weights())))
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)
        print(f"weights identical on all {hvd.size()} workers: {len(set(weights_agree)) == 1}", flush=True)
        print(f"Final test accuracy: {100.0 * test_accuracy:.2f}% after {args.epochs} epoch(s) "
              f"in {time.perf_counter() - started:.1f} s", flush=True)
    hvd.shutdown()
    return test_accuracy


if __name__ == "__main__":
    main()
