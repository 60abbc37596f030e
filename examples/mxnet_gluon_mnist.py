"""Data-parallel training of a small convolutional network on handwritten digits, with hora.mxnet (Gluon).

It follows the shape of Horovod's ``mxnet_mnist`` example (same flags, same steps) but needs no
download: the digits are scikit-learn's bundled set (1797 scans of handwritten digits, 8x8 pixels,
16 grey levels), split 80/20 into training and test images. MXNet 1.9.1 needs numpy<1.24, so run it
from the environment that holds MXNet (docs/mxnet.md):

    hora run -np 2 python examples/mxnet_gluon_mnist.py

What makes it distributed, step by step:
1. ``hvd.init()``; each worker keeps MXNet to one compute thread so the workers do not fight for cores;
2. each worker trains on its own shard of the training set (every size()-th image from its rank on);
3. the learning rate is multiplied by the number of workers (the global batch grows with it);
4. rank 0's initial parameters are broadcast with ``hvd.broadcast_parameters``;
5. ``hvd.DistributedTrainer`` averages the gradients over the workers at every ``trainer.step``;
6. each worker scores its shard of the test set and ``hvd.allreduce`` sums the counts before rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("MXNET_CPU_WORKER_NTHREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from sklearn.datasets import load_digits

import hora.mxnet as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="training batch size per worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=10, help="number of training epochs (default: 10)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one worker; scaled by the number of workers (default: 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                        help="apply gradient predivide factor in the trainer (default: 1.0)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    return parser.parse_args(argv)


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Training and test images (N, 1, 8, 8) scaled to [0, 1], with their labels: a fixed 80/20 split."""
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]
    labels = data.target.astype(np.float32)
    order = np.random.RandomState(0).permutation(len(images))
    cut = int(0.8 * len(images))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def build_net() -> gluon.nn.HybridSequential:
    """Two 3x3 convolutions, one 2x2 max-pool and two dense layers, sized for 8x8 inputs."""
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(16, kernel_size=3, padding=1, activation="relu"),
                gluon.nn.Conv2D(32, kernel_size=3, padding=1, activation="relu"),
                gluon.nn.MaxPool2D(pool_size=2),
                gluon.nn.Flatten(),
                gluon.nn.Dense(64, activation="relu"),
                gluon.nn.Dense(10))
    return net


def evaluate(net: gluon.Block, images: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy over every worker's shard of the test set (counts summed over workers)."""
    shard = slice(hvd.rank(), None, hvd.size())
    predictions = net(mx.nd.array(images[shard])).argmax(axis=1).asnumpy()
    counts = mx.nd.array([float((predictions == labels[shard]).sum()), float(len(labels[shard]))], dtype="float64")
    correct, total = hvd.allreduce(counts, op=hvd.Sum, name="test_counts").asnumpy()
    return correct / total


def main(argv=None) -> float:
    args = parse_args(argv)
    hvd.init()
    mx.random.seed(args.seed + hvd.rank())  # different on purpose: broadcast_parameters makes them equal
    np.random.seed(args.seed + hvd.rank())
    train_x, train_y, test_x, test_y = digits()
    shard_x, shard_y = train_x[hvd.rank()::hvd.size()], train_y[hvd.rank()::hvd.size()]

    net = build_net()
    net.initialize(mx.init.Xavier(magnitude=2.24))
    net(mx.nd.array(shard_x[:1]))  # finish deferred initialisation before the broadcast
    net.hybridize()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = mx.optimizer.SGD(learning_rate=args.lr * hvd.size(), momentum=args.momentum)
    trainer = hvd.DistributedTrainer(net.collect_params(), optimizer, compression=compression,
                                     gradient_predivide_factor=args.gradient_predivide_factor)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    start = time.perf_counter()
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        order = np.random.permutation(len(shard_x))
        total_loss = 0.0
        for begin in range(0, len(order), args.batch_size):
            batch = order[begin:begin + args.batch_size]
            data, label = mx.nd.array(shard_x[batch]), mx.nd.array(shard_y[batch])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(batch))
            total_loss += float(loss.sum().asscalar())
        mean_loss = hvd.allreduce(mx.nd.array([total_loss / len(shard_x)]), name="train_loss").asscalar()
        accuracy = evaluate(net, test_x, test_y)
        if hvd.rank() == 0:
            print(f"Epoch {epoch}: train loss {mean_loss:.4f}, test accuracy {100.0 * accuracy:.2f}%", flush=True)
    if hvd.rank() == 0:
        print(f"Test set: Accuracy: {100.0 * accuracy:.2f}% ({time.perf_counter() - start:.1f} s on "
              f"{hvd.size()} workers)", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
