"""Data-parallel softmax regression in plain NumPy, trained with hora.

Every worker holds a replica of the weights and a shard of the data; each step it computes its
gradient and hora averages the gradients across workers with ring-allreduce, so all replicas take the
same step. Run it with:

    hora run -np 2 python examples/numpy_logistic_regression.py

The data set is generated from a fixed seed (no download): 10 Gaussian clusters in 64 dimensions,
the shape of the 8x8 handwritten-digits problem.
"""

from __future__ import annotations

import argparse

import numpy as np

import hora as hvd


def make_dataset(samples: int, features: int = 64, classes: int = 10, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 1.0, size=(classes, features))
    labels = rng.integers(0, classes, size=samples)
    points = centers[labels] + rng.normal(0.0, 3.0, size=(samples, features))
    return points.astype(np.float32), labels


def softmax_loss_and_grad(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = -np.log(probs[np.arange(len(y)), y] + 1e-12).mean()
    probs[np.arange(len(y)), y] -= 1.0
    probs /= len(y)
    return loss, x.T @ probs, probs.sum(axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="scaled by the number of workers")
    parser.add_argument("--samples", type=int, default=20000)
    args = parser.parse_args()

    hvd.init()
    x, y = make_dataset(args.samples)
    split = int(0.8 * len(x))
    train_x, train_y, test_x, test_y = x[:split], y[:split], x[split:], y[split:]
    # Each worker takes every size()-th example: its shard of the training set.
    shard_x, shard_y = train_x[hvd.rank() :: hvd.size()], train_y[hvd.rank() :: hvd.size()]

    rng = np.random.default_rng(1234 + hvd.rank())  # deliberately different on each rank...
    w = rng.normal(0.0, 0.01, size=(x.shape[1], 10)).astype(np.float32)
    b = np.zeros(10, dtype=np.float32)
    # ...so broadcasting rank 0's initial weights is what makes the replicas identical.
    hvd.broadcast_(w, root_rank=0, name="w")
    hvd.broadcast_(b, root_rank=0, name="b")

    lr = args.lr * hvd.size()
    steps = len(shard_x) // args.batch_size
    for epoch in range(1, args.epochs + 1):
        order = np.random.default_rng(epoch).permutation(len(shard_x))
        losses = []
        for step in range(steps):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            loss, grad_w, grad_b = softmax_loss_and_grad(w, b, shard_x[idx], shard_y[idx])
            handles = [hvd.allreduce_async(grad_w, name="grad_w"), hvd.allreduce_async(grad_b, name="grad_b")]
            grad_w, grad_b = (hvd.synchronize(h) for h in handles)
            w -= lr * grad_w
            b -= lr * grad_b
            losses.append(loss)
        # Metric averaging: every worker's mean loss and test accuracy, averaged across workers.
        test_part = slice(hvd.rank(), None, hvd.size())
        accuracy = float(((test_x[test_part] @ w + b).argmax(axis=1) == test_y[test_part]).mean())
        metrics = hvd.allreduce(np.array([np.mean(losses), accuracy]), name="metrics")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {metrics[0]:.4f}  test accuracy {metrics[1]:.3f}  "
                  f"({hvd.size()} workers, {steps} steps of {args.batch_size} each)", flush=True)

    # Replicas must agree bit for bit: gather a checksum from every worker.
    checksums = hvd.allgather_object(float(np.abs(w).sum() + np.abs(b).sum()))
    if hvd.rank() == 0:
        same = len(set(checksums)) == 1
        print(f"weights identical on all {hvd.size()} workers: {same}", flush=True)
        if not same:
            raise SystemExit(f"replicas diverged: {checksums}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
