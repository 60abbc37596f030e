"""Data-parallel training of the digits network with PyTorch Lightning and hora.lightning.HoraStrategy.

The network and the data are ``pytorch_mnist.py``'s (scikit-learn's bundled 8x8 handwritten digits,
split 80/20, no download); here Lightning runs the loop. Run it with:

    hora run -np 2 python examples/pytorch_lightning_mnist.py

What makes it distributed is one argument, ``Trainer(strategy=HoraStrategy())``:
1. every worker joins the hora job when the Trainer is built; only rank 0 prints;
2. Lightning's automatic ``DistributedSampler`` gives each worker its own shard of the data;
3. the optimizer becomes a ``DistributedOptimizer``: gradients are averaged across workers;
4. rank 0's initial weights and optimizer settings are broadcast, so all replicas start equal;
5. metrics logged with ``sync_dist=True`` are averaged across workers.
As in the Horovod examples, the learning rate is scaled by the number of workers here, in
``configure_optimizers``: the global batch grows with them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import hora.torch as hvd
from hora.lightning import HoraStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_mnist import Net, digits_datasets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="CPU threads per worker (default: the host's cores divided among its workers)")
    return parser.parse_args(argv)


class DigitsClassifier(pl.LightningModule):
    """pytorch_mnist's ``Net`` with Lightning's steps: NLL loss, accuracy, SGD with momentum."""

    def __init__(self, lr: float, momentum: float) -> None:
        super().__init__()
        self.net = Net()
        self.lr, self.momentum = lr, momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        data, target = batch
        loss = F.nll_loss(self(data), target)
        self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch: Any, stage: str) -> None:
        data, target = batch
        output = self(data)
        # Each worker logs its shard's means; sync_dist averages them over workers, weighted by rows.
        self.log(f"{stage}_loss", F.nll_loss(output, target), sync_dist=True, batch_size=len(target))
        self.log(f"{stage}_acc", output.argmax(dim=1).eq(target).float().mean(), sync_dist=True,
                 batch_size=len(target))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # The global batch is size() times the per-worker batch: scale the learning rate with it.
        return torch.optim.SGD(self.parameters(), lr=self.lr * hvd.size(), momentum=self.momentum)


class PrintEpochs(pl.Callback):
    """One line per epoch from rank 0, with the metrics already averaged over workers."""

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # Runs after the epoch's validation, with this epoch's training and validation metrics.
        if trainer.is_global_zero:
            m = trainer.callback_metrics
            print(f"Epoch {trainer.current_epoch + 1}: train loss {float(m['train_loss']):.4f}, "
                  f"validation loss {float(m['val_loss']):.4f}, accuracy {100.0 * float(m['val_acc']):.2f}%",
                  flush=True)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    started = time.perf_counter()
    # Lightning's advice about workers and sampler padding does not apply to this tiny in-memory set.
    warnings.filterwarnings("ignore", message=r".*(does not have many workers|DistributedSampler).*")

    hvd.init()
    pl.seed_everything(args.seed, verbose=False)
    # Workers on one host share its cores: without a limit each would start one thread per core.
    torch.set_num_threads(args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))

    train_dataset, test_dataset = digits_datasets()
    # No sampler here: the strategy makes Lightning shard the data between workers.
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size)

    model = DigitsClassifier(args.lr, args.momentum)
    trainer = pl.Trainer(strategy=HoraStrategy(), accelerator="cpu", devices=1, max_epochs=args.epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[PrintEpochs()])
    if trainer.is_global_zero:
        print(f"Training on {trainer.world_size} worker(s): {len(train_dataset)} training and "
              f"{len(test_dataset)} test images of 8x8 digits", flush=True)
    trainer.fit(model, train_loader, test_loader)
    accuracy = float(trainer.test(model, test_loader, verbose=False)[0]["test_acc"])
    if trainer.is_global_zero:
        print(f"Test accuracy: {100.0 * accuracy:.2f}% on {trainer.world_size} worker(s) after {args.epochs} "
              f"epoch(s) in {time.perf_counter() - started:.1f} s", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
