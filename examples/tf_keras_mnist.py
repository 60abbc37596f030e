"""Data-parallel training of a small convolutional network on handwritten digits with Keras 2 (tf_keras).

The Keras 2 counterpart of ``examples/tensorflow2_keras_mnist.py``, for scripts that still run on
Keras 2: TensorFlow 2.21 runs them through the ``tf-keras`` package when ``TF_USE_LEGACY_KERAS=1``
is set before TensorFlow loads (this script sets it itself; under ``hora run`` it could equally be
exported in the launching shell). The data is scikit-learn's digits set (1797 8x8 scans), split
80/20 into training and test images, so nothing is downloaded. Run:

    hora run -np 2 python examples/tf_keras_mnist.py

Horovod's recipe, unchanged apart from the import line: ``hvd.init()``; a shard of the data per
worker; the learning rate scaled by the number of workers and warmed up to it; a
``DistributedOptimizer`` around a Keras 2 optimizer (``--legacy-optimizer`` picks
``tf_keras.optimizers.legacy.Adam``, created with Keras 2's ``lr=`` argument); the callbacks that
broadcast rank 0's initial state and average the metrics; rank 0 alone keeps the best model
(``BestModelCheckpoint``, with ``--checkpoint-dir``).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras and hora.keras become Keras 2 in this process
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import tf_keras as keras
from sklearn.datasets import load_digits

import hora.tensorflow.keras as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="batch size per worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=12, metavar="N", help="epochs to train (default: 12)")
    parser.add_argument("--lr", type=float, default=0.001, metavar="LR",
                        help="Adam learning rate of one worker; scaled by the number of workers (default: 0.001)")
    parser.add_argument("--warmup-epochs", type=int, default=2, metavar="N",
                        help="epochs over which the learning rate ramps up to the scaled rate (default: 2)")
    parser.add_argument("--legacy-optimizer", action="store_true",
                        help="use tf_keras.optimizers.legacy.Adam instead of tf_keras.optimizers.Adam")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="rank 0 saves the model with the best validation loss here (default: none)")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    return parser.parse_args(argv)


def digits_arrays(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits as normalised (8, 8, 1) float images, split 80/20 the same way on every worker."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., np.newaxis]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    split = int(0.8 * len(labels))
    images = (images - images[order[:split]].mean()) / images[order[:split]].std()
    return images[order[:split]], labels[order[:split]], images[order[split:]], labels[order[split:]]


def build_model() -> keras.Model:
    """Two 3x3 convolutions, a 2x2 max-pool and two dense layers, sized for 8x8 inputs."""
    return keras.Sequential([
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", input_shape=(8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10, activation="softmax"),
    ])


def main(argv=None) -> float:
    args = parse_args(argv)
    started = time.perf_counter()
    hvd.init()
    threads = max(1, (os.cpu_count() or 1) // hvd.local_size())  # the host's cores shared among its workers
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast aligns them

    train_x, train_y, test_x, test_y = digits_arrays()
    # Every worker runs the same number of steps (each is a collective): shards cut to whole batches.
    steps_per_epoch = max(1, len(train_x) // hvd.size() // args.batch_size)
    rows = steps_per_epoch * args.batch_size
    shard_x, shard_y = train_x[hvd.rank()::hvd.size()][:rows], train_y[hvd.rank()::hvd.size()][:rows]
    val_x, val_y = test_x[hvd.rank()::hvd.size()], test_y[hvd.rank()::hvd.size()]

    scaled_lr = args.lr * hvd.size()  # the global batch is size() times a worker's
    if args.legacy_optimizer:
        optimizer = keras.optimizers.legacy.Adam(lr=scaled_lr)  # Keras 2's `lr` spelling
    else:
        optimizer = keras.optimizers.Adam(learning_rate=scaled_lr)
    model = build_model()
    model.compile(loss="sparse_categorical_crossentropy", optimizer=hvd.DistributedOptimizer(optimizer),
                  metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),  # before the checkpoint, so it sees averages
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs,
                                                 steps_per_epoch=steps_per_epoch,
                                                 verbose=1 if hvd.rank() == 0 else 0),
    ]
    if args.checkpoint_dir:
        callbacks.append(hvd.callbacks.BestModelCheckpoint(
            monitor="val_loss", filepath=os.path.join(args.checkpoint_dir, "best.h5")))

    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} worker(s) with tf_keras {keras.__version__} "
              f"({type(optimizer).__module__}.{type(optimizer).__name__}), {threads} thread(s) each", flush=True)
    model.fit(shard_x, shard_y, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              validation_data=(val_x, val_y), verbose=2 if hvd.rank() == 0 else 0)

    loss, accuracy = model.evaluate(val_x, val_y, verbose=0)
    loss = float(hvd.allreduce(loss, name="avg_loss"))
    accuracy = float(hvd.allreduce(accuracy, name="avg_accuracy"))
    sums = hvd.allgather_object(float(sum(np.sum(w) for w in model.get_weights())))
    if hvd.rank() == 0:
        print(f"weights identical on all {hvd.size()} workers: {len(set(sums)) == 1}", flush=True)
        print(f"Final test accuracy: {100.0 * accuracy:.2f}% (loss {loss:.4f}) after {args.epochs} epoch(s) "
              f"in {time.perf_counter() - started:.1f} s", flush=True)
    hvd.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
