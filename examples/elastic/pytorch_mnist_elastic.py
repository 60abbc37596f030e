"""Elastic data-parallel training on handwritten digits with hora.torch: workers may come and go.

The elastic version of ``examples/pytorch_mnist.py`` (same network, same digits data: scikit-learn's
1797 8x8 scans, split 80/20), shaped like Horovod's ``pytorch_mnist_elastic`` example. Run it with:

    hora run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        python examples/elastic/pytorch_mnist_elastic.py

or, to try it on one machine with a fixed host list (a failed worker's host is dropped and the
others carry on): ``hora run -np 2 --min-np 1 --max-np 2 -H localhost:2 python ...``. See
docs/elastic.md for the launcher's flags and for how to grow and shrink a job on one machine.

What makes it elastic, step by step:
1. the training function is wrapped in ``@hvd.elastic.run``; when a worker fails or hosts are
   added or removed, the world is re-formed in the surviving processes and the function is called
   again, with the state every worker now shares;
2. that state is a ``TorchState``: the model, the optimizer, the ``ElasticSampler`` and the epoch
   and batch counters. ``state.commit()`` every few batches saves it (after a failure every worker
   goes back to the last commit) and is where a host change interrupts training;
3. the ``ElasticSampler`` shards the epoch's samples not processed yet over the current workers,
   so after a reset the epoch goes on where it stopped: each sample is trained on once per epoch;
4. the learning rate is scaled by the number of workers in a reset callback, since that number
   changes; evaluation shards the test set by the current rank and size each time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data

import hora.torch as hvd

# The network and the data are examples/pytorch_mnist.py's.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pytorch_mnist import Net, digits_datasets


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, metavar="N",
                        help="input batch size for training, per worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=5, metavar="N",
                        help="number of epochs to train (default: 5)")
    parser.add_argument("--lr", type=float, default=0.05, metavar="LR",
                        help="learning rate of one worker; scaled by the number of workers (default: 0.05)")
    parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum (default: 0.5)")
    parser.add_argument("--batches-per-commit", type=int, default=5, metavar="N",
                        help="commit the state every N batches (default: 5)")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                        help="how many batches to wait before logging training status (default: 10)")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--num-threads", type=int, default=1, metavar="N",
                        help="CPU threads per worker (default: 1)")
    args = parser.parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


def evaluate(model, test_dataset, device) -> tuple[float, float]:
    """Test loss and accuracy over the whole test set, each worker taking every size()-th image."""
    model.eval()
    images, labels = test_dataset[hvd.rank()::hvd.size()]
    with torch.no_grad():
        output = model(images.to(device))
        loss = F.nll_loss(output, labels.to(device), reduction="sum").item()
        correct = output.argmax(dim=1).eq(labels.to(device)).sum().item()
    # Sums over the workers, not averages: the shards may differ in length by one image.
    loss, correct = hvd.allreduce(torch.tensor([loss, correct], dtype=torch.float64), op=hvd.Sum,
                                  name="test_metrics").tolist()
    return loss / len(test_dataset), correct / len(test_dataset)


def main(argv=None) -> float:
    args = parse_args(argv)
    started = time.perf_counter()

    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.manual_seed(args.seed)
    device = torch.device("cuda" if args.cuda else "cpu")
    torch.set_num_threads(args.num_threads)

    train_dataset, test_dataset = digits_datasets()
    # The ElasticSampler gives this worker its share of the samples of the epoch not yet processed,
    # re-sharded whenever the world changes. It does not pad: shards may differ by one sample.
    train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    no_batch = train_dataset[0:0]  # what a worker whose shard ran out trains on in the last step

    model = Net().to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average)

    @hvd.elastic.run
    def train(state) -> None:
        # Called again after every reset, with the state synchronised (rank 0's) and the sampler
        # re-sharded over the new world: no broadcast_parameters is needed here.
        while state.epoch < args.epochs:
            state.model.train()
            # The steps left in this epoch: the same number on every worker, so all of them take
            # part in every gradient allreduce, even one whose shard is a sample short.
            steps = math.ceil(train_sampler.total_size / (args.batch_size * hvd.size()))
            batches = iter(train_loader)
            for batch_idx in range(steps):
                data, target = next(batches, no_batch)
                data, target = data.to(device), target.to(device)
                state.optimizer.zero_grad()
                # Summed over the batch and divided by the full batch size: a short (or empty) last
                # batch weighs what its samples weigh.
                loss = F.nll_loss(state.model(data), target, reduction="sum") / args.batch_size
                loss.backward()
                state.optimizer.step()
                # Marks this step's samples of every worker as processed (part of the next commit).
                train_sampler.record_batch(batch_idx, args.batch_size)
                state.batch += 1
                if state.batch % args.log_interval == 0 and hvd.rank() == 0:
                    done = len(train_sampler.processed_indices)
                    print(f"Train Epoch: {state.epoch + 1} [{done}/{len(train_dataset)} "
                          f"({100.0 * done / len(train_dataset):.0f}%)]\tLoss: {loss.item():.6f}", flush=True)
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            test_loss, accuracy = evaluate(state.model, test_dataset, device)
            if hvd.rank() == 0:
                print(f"Epoch {state.epoch + 1}: {hvd.size()} worker(s), test loss {test_loss:.4f}, "
                      f"accuracy {100.0 * accuracy:.2f}%", flush=True)
            state.epoch += 1
            state.batch = 0
            train_sampler.set_epoch(state.epoch)
            state.commit()

    def on_state_reset() -> None:
        # The global batch is size() times the per-worker batch, and size() just changed.
        for param_group in optimizer.param_groups:
            param_group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"World re-formed: {hvd.size()} worker(s), learning rate {args.lr * hvd.size():g}", flush=True)

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])
    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} worker(s): {len(train_dataset)} training and {len(test_dataset)} "
              "test images of 8x8 digits", flush=True)
    train(state)

    _, accuracy = evaluate(model, test_dataset, device)
    if hvd.rank() == 0:
        print(f"Final test accuracy: {100.0 * accuracy:.2f}% after {args.epochs} epoch(s) on {hvd.size()} "
              f"worker(s) in {time.perf_counter() - started:.1f} s", flush=True)
    hvd.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
