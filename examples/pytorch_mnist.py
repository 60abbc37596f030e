"""Data-parallel training of a small convolutional network on handwritten digits, with hora.torch.

The script follows the shape of Horovod's ``pytorch_mnist`` example (same flags, same steps) but
needs no download: the digits are scikit-learn's bundled set (1797 scans of handwritten digits,
8x8 pixels, 16 grey levels), split 80/20 into training and test images. Run it with:

    hora run -np 2 python examples/pytorch_mnist.py

What makes it distributed, step by step:
1. ``hvd.init()``, then each worker limits its CPU threads so the workers do not fight for cores;
2. a ``DistributedSampler`` gives each worker its own shard of the training and test sets;
3. the learning rate is multiplied by the number of workers (the global batch grows with it);
4. ``DistributedOptimizer`` averages gradients across workers during the backward pass;
5. rank 0's initial weights and optimizer state are broadcast, so all replicas start equal;
6. test loss and accuracy are averaged across workers with ``hvd.allreduce`` before rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import hora.torch as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, metavar="N",
                        help="input batch size for training, per worker (default: 32)")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N",
                        help="input batch size for testing (default: 1000)")
    parser.add_argument("--epochs", type=int, default=10, metavar="N",
                        help="number of epochs to train (default: 10)")
    parser.add_argument("--lr", type=float, default=0.05, metavar="LR",
                        help="learning rate of one worker; scaled by the number of workers (default: 0.05)")
    parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum (default: 0.5)")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    parser.add_argument("--log-interval", type=int, default=5, metavar="N",
                        help="how many batches to wait before logging training status (default: 5)")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--use-mixed-precision", action="store_true", default=False,
                        help="use mixed precision for training (needs CUDA)")
    parser.add_argument("--use-adasum", action="store_true", default=False,
                        help="use adasum algorithm to do reduction (see adasum_pytorch_mnist.py)")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                        help="apply gradient predivide factor in optimizer (default: 1.0)")
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="CPU threads per worker (default: the host's cores divided among its workers)")
    parser.add_argument("--data-dir", default=None,
                        help="accepted for compatibility with Horovod's example; the digits ship with "
                             "scikit-learn, so nothing is read from or written to it")
    args = parser.parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


class Net(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool and two fully connected layers, sized for 8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d(0.1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))                                 # 16 x 8 x 8
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # 32 x 4 x 4
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, p=0.25, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets(seed: int = 0) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """scikit-learn's handwritten digits as (1, 8, 8) float images in [0, 1], split 80/20.

    The split is a fixed permutation, so it is the same on every worker.
    """
    digits = load_digits()
    images = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(labels)))
    split = int(0.8 * len(labels))
    train_idx, test_idx = order[:split], order[split:]
    # Normalise with the training images' statistics (MNIST's (0.1307, 0.3081) in Horovod's example).
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    train = torch.utils.data.TensorDataset(images[train_idx], labels[train_idx])
    test = torch.utils.data.TensorDataset(images[test_idx], labels[test_idx])
    return train, test


def metric_average(value: float, name: str) -> float:
    """The mean of ``value`` over all workers."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def train(epoch: int, model, optimizer, train_loader, train_sampler, device, scaler, args) -> None:
    model.train()
    # Each epoch, the sampler reshuffles (the same permutation on every worker, different shards).
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        if scaler is not None:
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = F.nll_loss(model(data), target)
            scaler.scale(loss).backward()
            # The optimizer's step synchronises itself; make sure the averaged gradients are in place
            # before the scaler unscales them, then let the scaler call step() without a second sync.
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        else:
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            # len(train_sampler) is this worker's share of the training set.
            seen = batch_idx * len(data)
            print(f"Train Epoch: {epoch} [{seen}/{len(train_sampler)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}", flush=True)


def test(model, test_loader, test_sampler, device) -> tuple[float, float]:
    model.eval()
    test_loss = 0.0
    correct = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).float().sum().item()
    # This worker's averages over its shard of the test set...
    test_loss /= len(test_sampler)
    accuracy = correct / len(test_sampler)
    # ...averaged over all workers.
    test_loss = metric_average(test_loss, "avg_loss")
    accuracy = metric_average(accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * accuracy:.2f}%\n", flush=True)
    return test_loss, accuracy


def main(argv=None) -> float:
    args = parse_args(argv)
    if args.use_mixed_precision and not args.cuda:
        raise SystemExit("--use-mixed-precision needs CUDA (torch.cuda.is_available() is False here)")
    started = time.perf_counter()

    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        # One GPU per worker on this host, picked by local rank.
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())  # ranks may share a GPU
        torch.cuda.manual_seed(args.seed)
    device = torch.device("cuda" if args.cuda else "cpu")

    # Workers on one host share its cores: without a limit each would start one thread per core and
    # they would spend their time preempting each other.
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)

    train_dataset, test_dataset = digits_datasets()
    loader_kwargs = {"pin_memory": True} if args.cuda else {}
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler, **loader_kwargs)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler, **loader_kwargs)

    model = Net().to(device)
    # The global batch is size() times the per-worker batch: scale the learning rate with it
    # (not with Adasum, which adds the workers' updates only where they are orthogonal).
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Every replica starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    scaler = torch.amp.GradScaler("cuda") if args.use_mixed_precision else None

    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} worker(s) ({device.type}, {threads} thread(s) each): "
              f"{len(train_dataset)} training and {len(test_dataset)} test images of 8x8 digits", flush=True)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train(epoch, model, optimizer, train_loader, train_sampler, device, scaler, args)
        _, accuracy = test(model, test_loader, test_sampler, device)

    if hvd.rank() == 0:
        print(f"Final test accuracy: {100.0 * accuracy:.2f}% after {args.epochs} epoch(s) "
              f"in {time.perf_counter() - started:.1f} s", flush=True)
    hvd.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
