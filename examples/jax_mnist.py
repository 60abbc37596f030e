"""Data-parallel training of a small network on handwritten digits, with plain JAX, optax and hora.jax.

Horovod has no JAX binding; this script is what its ``pytorch_mnist`` example looks like in JAX. The
digits are scikit-learn's bundled set (1797 scans, 8x8 pixels), split 80/20. Run it with:

    hora run -np 2 python examples/jax_mnist.py

What makes it distributed, step by step:
1. ``hvd.init()``; each worker takes its own shard of the (identically shuffled) training set;
2. the learning rate is multiplied by the number of workers (the global batch grows with it);
3. ``hvd.DistributedOptimizer`` wraps the optax optimizer: inside the jitted train step, the gradients
   are averaged across workers (one host callback per step) before the optimizer sees them;
4. rank 0's initial parameters and optimizer state are broadcast, so all replicas start equal;
5. test loss and accuracy are averaged across workers with ``hvd.allreduce`` before rank 0 prints.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import hora.jax as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=10, help="number of epochs (default: 10)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker, scaled by the number "
                                                               "of workers (default: 0.05)")
    parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum (default: 0.5)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    parser.add_argument("--backward-passes-per-step", type=int, default=1,
                        help="micro-batches whose gradients are summed locally before each allreduce (default: 1)")
    return parser.parse_args(argv)


def digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits as flat float32 vectors normalised with the training statistics, split 80/20 by a
    fixed permutation (the same on every worker)."""
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32).reshape(len(data.target), -1)
    labels = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    split = int(0.8 * len(labels))
    train, test = order[:split], order[split:]
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return images[train], labels[train], images[test], labels[test]


def init_params(key: jax.Array, sizes=(64, 128, 64, 10)) -> list[dict[str, jax.Array]]:
    """A multilayer perceptron's weights (He initialisation) and zero biases."""
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2.0 / n_in), "b": jnp.zeros(n_out)})
    return params


def logits(params, x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def main(argv=None) -> float:
    args = parse_args(argv)
    started = time.perf_counter()
    hvd.init()
    x_train, y_train, x_test, y_test = digits()

    params = init_params(jax.random.PRNGKey(args.seed + hvd.rank()))  # different on purpose: the broadcast fixes it
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    tx = hvd.DistributedOptimizer(optax.sgd(args.lr * hvd.size(), momentum=args.momentum), compression=compression,
                                  backward_passes_per_step=args.backward_passes_per_step)
    opt_state = tx.init(params)
    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = hvd.broadcast_optimizer_state(opt_state, root_rank=0)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)  # averaged across workers in here
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def evaluate(params, x, y):
        out = logits(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), (out.argmax(-1) == y).mean()

    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} worker(s): {len(y_train)} training and {len(y_test)} test images of "
              f"8x8 digits", flush=True)
    rng = np.random.default_rng(args.seed)
    steps = len(y_train) // (args.batch_size * hvd.size())  # the same number of steps on every worker
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(y_train))  # the same permutation everywhere; each worker takes its shard
        shard = order[hvd.rank()::hvd.size()]
        for step in range(steps):
            idx = shard[step * args.batch_size:(step + 1) * args.batch_size]
            params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
        # This worker's share of the test set, then the mean over workers.
        mine = np.arange(hvd.rank(), len(y_test), hvd.size())
        test_loss, test_acc = evaluate(params, x_test[mine], y_test[mine])
        test_loss = float(hvd.allreduce(test_loss, name="avg_loss"))
        accuracy = float(hvd.allreduce(test_acc, name="avg_accuracy"))
        if hvd.rank() == 0:
            print(f"Epoch {epoch}: train loss {float(loss):.4f}, test loss {test_loss:.4f}, "
                  f"accuracy {100.0 * accuracy:.2f}%", flush=True)
    if hvd.rank() == 0:
        print(f"Final test accuracy: {100.0 * accuracy:.2f}% after {args.epochs} epoch(s) on {hvd.size()} "
              f"worker(s) in {time.perf_counter() - started:.1f}s", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
