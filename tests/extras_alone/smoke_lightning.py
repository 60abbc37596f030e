"""The lightning extra alone: a Lightning Trainer with hora's HoraStrategy fits a one-layer model for
2 steps on 2 ranks (``hora run -np 2``).

The strategy must do three things for the final weights to come out as the test expects: broadcast
rank 0's initial weights [0.5, -0.25, 1.0] over rank 1's zeros, give each rank its own row of the
2-row dataset (row i is (i + 1) * [1, 1, 1]; Lightning's DistributedSampler, not shuffled), and
average the gradients. Loss mean((x . w)^2), SGD 0.1: step 1 averages 2.5 and 10.0 to 6.25, giving
[-0.125, -0.875, 0.375]; step 2 averages -1.25 and -5.0 to -3.125, giving [0.1875, -0.5625, 0.6875].
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from smoke_report import report  # this folder: on the path of a script run from it

import hora.torch as hvd
from hora.lightning import HoraStrategy


class OneLayer(pl.LightningModule):
    """w . x without bias; rank 1 starts from zeros so that only the strategy's broadcast aligns it."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            self.net.weight.copy_(torch.tensor([[0.5, -0.25, 1.0]]) if rank == 0 else torch.zeros(1, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    hvd.init()
    rank = hvd.rank()
    rows = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=1, shuffle=False)
    module = OneLayer(rank)
    trainer = pl.Trainer(strategy=HoraStrategy(), accelerator="cpu", devices=1, max_steps=2, max_epochs=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader)

    report({
        "rank": rank, "size": hvd.size(), "world_size": trainer.world_size, "global_step": trainer.global_step,
        "weights": module.net.weight.detach().flatten().tolist(),
    })
    hvd.shutdown()


if __name__ == "__main__":
    main()
