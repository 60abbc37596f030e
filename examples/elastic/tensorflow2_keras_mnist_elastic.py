"""Elastic data-parallel training on handwritten digits with Keras 3 and hora.keras: workers may come and go.

The elastic version of ``examples/tensorflow2_keras_mnist.py`` (same network, same digits data:
scikit-learn's 1797 8x8 scans, split 80/20), shaped like Horovod's ``tensorflow2_keras_mnist_elastic``
example: ``model.fit`` inside ``@hvd.elastic.run``, with the state kept up to date by callbacks. Run:

    hora run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        python examples/elastic/tensorflow2_keras_mnist_elastic.py

or, to try it on one machine with a fixed host list (a failed worker's host is dropped and the
others carry on): ``hora run -np 2 --min-np 1 --max-np 2 -H localhost:2 python ...``. See
docs/elastic.md for the launcher's flags and for how to grow and shrink a job on one machine.

What makes it elastic, step by step:
1. ``model.fit`` is called inside a function wrapped in ``@hvd.elastic.run``; when a worker fails or
   hosts are added or removed, the world is re-formed in the surviving processes and the function
   is called again, with the state every worker now shares (rank 0's), for the epochs left:
   ``epochs=args.epochs - state.epoch``;
2. that state is a ``KerasState``: the model's weights, the optimizer's variables and the epoch and
   batch counters. ``UpdateEpochStateCallback`` and ``UpdateBatchStateCallback`` keep the counters
   current and ``CommitStateCallback`` (last in the list, so each commit holds them) saves the state
   every few batches and at every epoch's end: after a failure every worker goes back to the last
   commit, and a commit is where a host change interrupts training;
3. no ``BroadcastGlobalVariablesCallback``: ``hvd.elastic.run`` gives every worker rank 0's state
   before the first ``fit`` and after every reset that may have brought new workers;
4. whatever depends on the number of workers is computed again in each call of the training
   function (each worker's shard of the data, the steps per epoch) or in a reset callback (the
   learning rate, scaled by the number of workers).

As in Horovod's example, an epoch interrupted in its middle is trained again from its first batch
after the reset (from the weights of the last commit). The Keras backend is whatever Keras was
imported with: TensorFlow by default, or torch with ``KERAS_BACKEND=torch``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter, before it loads

import keras
import numpy as np

import hora.keras as hvd

# The network, the data and the thread limit are examples/tensorflow2_keras_mnist.py's.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensorflow2_keras_mnist import build_model, digits_arrays, limit_threads


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, metavar="N",
                        help="input batch size for training, per worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=5, metavar="N", help="number of epochs to train (default: 5)")
    parser.add_argument("--lr", type=float, default=0.002, metavar="LR",
                        help="Adam learning rate of one worker; scaled by the number of workers (default: 0.002)")
    parser.add_argument("--batches-per-commit", type=int, default=5, metavar="N",
                        help="commit the state every N batches, and at every epoch's end (default: 5)")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="CPU threads per worker (default: the host's cores divided among its workers)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="rank 0 saves a checkpoint per epoch here (default: no checkpoints)")
    parser.add_argument("--verbose", type=int, default=0, choices=(0, 1, 2),
                        help="Keras' own progress output on rank 0 (default: 0, only this script's lines)")
    return parser.parse_args(argv)


class EpochReport(keras.callbacks.Callback):
    """Rank 0 prints each epoch's world size and (averaged) metrics. Placed after
    ``MetricAverageCallback`` (the averages) and ``UpdateEpochStateCallback`` (the epoch count)."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        if hvd.rank() == 0:
            print(f"Epoch {self.state.epoch}: {hvd.size()} worker(s), loss {logs.get('loss', float('nan')):.4f}, "
                  f"accuracy {100.0 * logs.get('accuracy', float('nan')):.2f}%, "
                  f"test accuracy {100.0 * logs.get('val_accuracy', float('nan')):.2f}%", flush=True)


def main(argv=None) -> float:
    args = parse_args(argv)
    started = time.perf_counter()

    hvd.init()
    threads = limit_threads(args.num_threads)
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the first sync aligns them
    train_x, train_y, test_x, test_y = digits_arrays()

    model = build_model()
    # The learning rate is set for the current number of workers in on_state_reset below, too.
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr * hvd.size()))
    # jit_compile=False: XLA cannot host hora's collectives.
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=optimizer, metrics=["accuracy"],
                  jit_compile=False)

    def on_state_reset() -> None:
        # The global batch is size() times the per-worker batch, and size() just changed.
        model.optimizer.learning_rate.assign(args.lr * hvd.size())
        if hvd.rank() == 0:
            print(f"World re-formed: {hvd.size()} worker(s), learning rate {args.lr * hvd.size():g}", flush=True)

    # The model's weights, the optimizer's variables (its slots too: KerasState builds it) and two
    # counters, all synced from rank 0 before the first fit: no BroadcastGlobalVariablesCallback.
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([on_state_reset])

    callbacks = [
        # Logged metrics become averages over the workers (before the callbacks that read them).
        hvd.callbacks.MetricAverageCallback(),
        # Keep state.epoch and state.batch current...
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        EpochReport(state),
        # ...and commit them with the weights, last: every few batches and at every epoch's end.
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
    ]
    if hvd.rank() == 0 and args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

    @hvd.elastic.run
    def train(state) -> None:
        # Called again after every reset, in the new world: each worker takes its shard of the data
        # for the current rank and size. Every worker must run the same number of steps (each step
        # is a collective), so the shards are cut to the same whole number of batches.
        steps_per_epoch = max(1, len(train_x) // hvd.size() // args.batch_size)
        rows = steps_per_epoch * args.batch_size
        shard_x, shard_y = train_x[hvd.rank()::hvd.size()][:rows], train_y[hvd.rank()::hvd.size()][:rows]
        validation = (test_x[hvd.rank()::hvd.size()], test_y[hvd.rank()::hvd.size()])
        state.model.fit(shard_x, shard_y, batch_size=args.batch_size, epochs=args.epochs - state.epoch,
                        validation_data=validation, callbacks=callbacks,
                        verbose=args.verbose if hvd.rank() == 0 else 0)

    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} worker(s) (Keras {keras.__version__}, {keras.backend.backend()} backend, "
              f"{threads} thread(s) each): {len(train_x)} training and {len(test_x)} test images of 8x8 digits",
              flush=True)
    train(state)

    # Each worker scores its shard of the test set; the test metrics are the sums over the workers.
    _, shard_accuracy = model.evaluate(test_x[hvd.rank()::hvd.size()], test_y[hvd.rank()::hvd.size()], verbose=0)
    shard_rows = len(test_x[hvd.rank()::hvd.size()])
    correct = float(hvd.allreduce(np.array(shard_accuracy * shard_rows, dtype=np.float64), op=hvd.Sum,
                                  name="test_correct"))
    accuracy = correct / len(test_x)
    weights_agree = hvd.allgather_object(float(sum(np.sum(w) for w in model.get_weights())))
    if hvd.rank() == 0:
        print(f"weights identical on all {hvd.size()} workers: {len(set(weights_agree)) == 1}", flush=True)
        print(f"Final test accuracy: {100.0 * accuracy:.2f}% after {args.epochs} epoch(s) on {hvd.size()} "
              f"worker(s) in {time.perf_counter() - started:.1f} s", flush=True)
    hvd.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
