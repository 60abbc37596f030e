"""The digits example trained with Adasum: ``DistributedOptimizer(op=hvd.Adasum)``.

The model, data and training loop are ``pytorch_mnist.py``'s (scikit-learn's bundled 8x8 digits, no
download). What changes with Adasum, as in Horovod's example:
- each worker takes a local optimizer step on its own gradients and the *weight deltas* are combined
  with Adasum, which adds orthogonal updates and averages parallel ones;
- so the learning rate is that of one worker, not multiplied by the number of workers (Horovod scales
  it by the local size only when NCCL averages inside a host first).

Run it with:

    hora run -np 2 python examples/adasum_pytorch_mnist.py [--compare-average]

``--compare-average`` trains a second time from the same initial weights with ``op=hvd.Average``
(learning rate scaled by the number of workers) and prints both accuracies.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.optim as optim
import torch.utils.data
import torch.utils.data.distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_mnist  # the shared model, data and loops

import hora.torch as hvd


def fit(args, op: int, train_dataset, test_dataset) -> float:
    """Train a fresh model with ``op`` for ``args.epochs`` epochs; the final test accuracy."""
    torch.manual_seed(args.seed)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)
    model = pytorch_mnist.Net()
    # Adasum: one worker's learning rate. Average: scaled with the global batch.
    lr_scaler = 1 if op == hvd.Adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=op)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        pytorch_mnist.train(epoch, model, optimizer, train_loader, train_sampler, torch.device("cpu"), None, args)
        _, accuracy = pytorch_mnist.test(model, test_loader, test_sampler, torch.device("cpu"))
    return accuracy


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare = "--compare-average" in argv
    if compare:
        argv.remove("--compare-average")
    args = pytorch_mnist.parse_args(argv)
    started = time.perf_counter()
    hvd.init()
    torch.set_num_threads(args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))
    train_dataset, test_dataset = pytorch_mnist.digits_datasets()
    results = {"adasum": fit(args, hvd.Adasum, train_dataset, test_dataset)}
    if compare:
        results["average"] = fit(args, hvd.Average, train_dataset, test_dataset)
    if hvd.rank() == 0:
        for label, accuracy in results.items():
            print(f"Final test accuracy ({label}): {100.0 * accuracy:.2f}% after {args.epochs} epoch(s)", flush=True)
        print(f"Done in {time.perf_counter() - started:.1f} s on {hvd.size()} worker(s)", flush=True)
    hvd.shutdown()
    return results


if __name__ == "__main__":
    main()
