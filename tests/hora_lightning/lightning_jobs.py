"""Lightning training runs for the HoraStrategy tests: one definition of the data, the modules and
the Trainer, used by the single-process baselines (in the test process) and by the workers that
``hora.run`` starts (they import this module by name: pytest puts this directory on ``sys.path`` and
``hora.run`` hands that path on).

The equivalence runs are built so that N workers see exactly the 1-worker batch between them.
Under HoraStrategy, Lightning puts a DistributedSampler in the training loader: every epoch it
shuffles the rows with one permutation (seed 0 + epoch, the same on every rank) and gives rank r
positions r, r+N, r+2N, ... of it. With a per-rank batch of B/N, the union of the ranks' k-th
batches is positions kB..kB+B-1 of the permutation, which is the k-th batch of a 1-process run whose
sampler is that permutation whole (a DistributedSampler of one replica). The losses are batch
means, so averaged gradients equal the whole batch's gradients.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

GLOBAL_BATCH = 8
ROWS = 80              # 10 steps per epoch at the global batch
EPOCHS = 2             # 20 optimizer steps in all
INIT_SEED = 1234


def quiet() -> None:
    """One compute thread (the workers share few cores) and none of Lightning's advice on stderr."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 6, generator=generator)
    y = (x[:, 0] + 2 * x[:, 1] - x[:, 2] > 0).long() + (x[:, 3] > 0.5).long()
    return torch.utils.data.TensorDataset(x, y)


def make_module(optimizer: str, batch_norm: bool = False, init_seed: int = INIT_SEED, manual: bool = False) -> Any:
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        """A small MLP (optionally with batch norm) whose optimizer is picked by name; ``manual``
        steps it by hand (Lightning's manual optimization) instead of through Lightning's closure."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual
            torch.manual_seed(init_seed)
            layers: list[torch.nn.Module] = [torch.nn.Linear(6, 16)]
            if batch_norm:
                layers.append(torch.nn.BatchNorm1d(16))
            layers += [torch.nn.Tanh(), torch.nn.Linear(16, 3)]
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            if optimizer == "adam":
                return torch.optim.Adam(self.parameters(), lr=0.01)
            raise ValueError(optimizer)

    return Classifier()


def trainer(strategy: Any = "auto", **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    options = dict(accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def params_of(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """Parameters and float buffers (batch-norm running statistics), as NumPy arrays."""
    return {name: t.detach().cpu().numpy().copy() for name, t in module.state_dict().items()
            if t.is_floating_point()}


def train(optimizer: str, strategy: Any = "auto", world: int = 1, batch_norm: bool = False,
          accumulate: int = 1, init_seed: int = INIT_SEED, manual: bool = False,
          accumulation_schedule: dict[int, int] | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    """Train the classifier for 2 epochs of GLOBAL_BATCH rows per step (times the accumulation);
    return its final state."""
    module = make_module(optimizer, batch_norm=batch_norm, init_seed=init_seed, manual=manual)
    per_rank_batch = GLOBAL_BATCH // world // accumulate
    data = dataset()
    # On N workers the loader has no sampler: the strategy must make Lightning shard (and shuffle) it.
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) \
        if world == 1 else None
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank_batch, sampler=sampler)
    if accumulation_schedule is not None:
        import lightning.pytorch as pl

        trainer_kwargs["callbacks"] = [pl.callbacks.GradientAccumulationScheduler(accumulation_schedule)]
    else:
        trainer_kwargs["accumulate_grad_batches"] = accumulate
    fit = trainer(strategy, **trainer_kwargs)
    fit.fit(module, loader)
    return {"params": params_of(module), "global_step": fit.global_step, "world_size": fit.world_size,
            "global_rank": fit.global_rank}


@dataclass(frozen=True)
class Case:
    """One equivalence case: ``train``'s arguments for the 1-process baseline (``common``) and the
    extra ones the workers add (``workers_only``: what only makes sense with several ranks)."""

    optimizer: str
    common: dict[str, Any] = field(default_factory=dict)
    workers_only: dict[str, Any] = field(default_factory=dict)

    def baseline(self) -> dict[str, Any]:
        quiet()
        common = {k: v for k, v in self.common.items() if k != "accumulate"}  # the whole batch at once
        return train(self.optimizer, **common)


EQUIVALENCE_CASES = {
    "sgd": Case("sgd"),
    "adam": Case("adam"),
    "sgd_accumulate_2": Case("sgd", {"accumulate": 2}),
    # Epoch 0 steps every batch, epoch 1 every 2 batches: the strategy follows the schedule.
    "sgd_accumulation_schedule": Case("sgd", {"accumulation_schedule": {1: 2}}),
    "sgd_sync_batchnorm": Case("sgd", {"batch_norm": True}, {"sync_batchnorm": True}),
    "adam_manual_optimization": Case("adam", {"manual": True}),
}


def worker_equivalence_runs() -> dict[str, Any]:
    """Every equivalence case on this rank, under HoraStrategy. Rank r builds its model from a
    different seed: only rank 0's weights may survive the initial broadcast."""
    quiet()
    import hora.torch as hvd
    from hora.lightning import HoraStrategy

    hvd.init()
    return {name: train(case.optimizer, HoraStrategy(), world=hvd.size(), init_seed=INIT_SEED + hvd.rank(),
                        **case.common, **case.workers_only)
            for name, case in EQUIVALENCE_CASES.items()}


def worker_metrics() -> dict[str, Any]:
    """Logged metrics, collectives and the sampler's shards as each rank sees them."""
    quiet()
    import lightning.pytorch as pl

    import hora.torch as hvd
    from hora.lightning import HoraStrategy

    hvd.init()
    seen: dict[str, Any] = {"train_rows": [], "val_rows": []}

    class Logs(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (rows,) = batch
            seen["train_rows"] += rows.flatten().long().tolist()
            rank = float(self.global_rank)
            self.log("rank_mean", rank, sync_dist=True, on_step=False, on_epoch=True, batch_size=len(rows))
            self.log("rank_sum", rank + 1, sync_dist=True, reduce_fx="sum", on_step=False, on_epoch=True)
            self.log("rank_max", rank, sync_dist=True, reduce_fx="max", on_step=False, on_epoch=True)
            self.log("rank_step", rank, sync_dist=True, on_step=True, on_epoch=False)
            self.log("own_rank", rank, on_step=False, on_epoch=True)
            return self.layer(rows).pow(2).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            (rows,) = batch
            seen["val_rows"] += rows.flatten().long().tolist()
            self.log("val_rows_mean", rows.float().mean(), sync_dist=True, batch_size=len(rows))

        def on_train_end(self) -> None:
            strategy = self.trainer.strategy
            seen["all_gather"] = self.all_gather(torch.tensor([self.global_rank, 10])).tolist()
            seen["broadcast_from_1"] = strategy.broadcast({"from": self.global_rank}, src=1)
            seen["reduce_int_mean"] = float(strategy.reduce(torch.tensor(self.global_rank), reduce_op="mean"))
            seen["reduce_sum"] = float(strategy.reduce(torch.tensor(float(self.global_rank + 1)), reduce_op="sum"))
            seen["reduce_max_op"] = float(strategy.reduce(torch.tensor(float(self.global_rank)),
                                                          reduce_op=torch.distributed.ReduceOp.MAX))
            seen["any_true"] = strategy.reduce_boolean_decision(self.global_rank == 1, all=False)
            seen["all_true"] = strategy.reduce_boolean_decision(self.global_rank == 1, all=True)
            strategy.barrier("end")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    rows = torch.arange(12, dtype=torch.float32).unsqueeze(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=3, shuffle=False)
    val_rows = torch.arange(100, 110, dtype=torch.float32).unsqueeze(1)
    val_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(val_rows), batch_size=5)
    fit = trainer(HoraStrategy(), max_epochs=1)
    fit.fit(Logs(), loader, val_loader)
    seen["metrics"] = {k: float(v) for k, v in fit.callback_metrics.items()}
    seen["rank"], seen["world_size"] = fit.global_rank, fit.world_size
    seen["is_global_zero"] = fit.is_global_zero
    seen["sampler"] = {"num_replicas": fit.strategy.distributed_sampler_kwargs["num_replicas"],
                       "rank": fit.strategy.distributed_sampler_kwargs["rank"]}
    seen["pid"] = os.getpid()
    return seen


def worker_refit() -> dict[str, Any]:
    """Two fits of one model in one process: the first fit's gradient hooks must be gone, or the
    second would reduce every gradient twice (under one name) and fail or diverge."""
    quiet()
    import hora.torch as hvd
    from hora.lightning import HoraStrategy

    hvd.init()
    module = make_module("sgd", init_seed=INIT_SEED + hvd.rank())
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // hvd.size())
    for _ in range(2):
        trainer(HoraStrategy(), max_epochs=1).fit(module, loader)
    return params_of(module)


def worker_checkpoint_resume(directory: str) -> dict[str, np.ndarray]:
    """Adam for one epoch with Lightning's ModelCheckpoint (rank 0 writes, every rank waits), then
    a fresh model and Trainer resume from that checkpoint for the second epoch: the weights and the
    optimizer state come back through the DistributedOptimizer, so the result is the uninterrupted
    2-epoch run's."""
    quiet()
    import hora.torch as hvd
    from hora.lightning import HoraStrategy

    hvd.init()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // hvd.size())
    first = trainer(HoraStrategy(), max_epochs=1, enable_checkpointing=True, default_root_dir=directory)
    first.fit(make_module("adam", init_seed=INIT_SEED + hvd.rank()), loader)
    path = hvd.broadcast_object(first.checkpoint_callback.best_model_path, root_rank=0)
    resumed = make_module("adam", init_seed=INIT_SEED + 100 + hvd.rank())
    trainer(HoraStrategy(), max_epochs=EPOCHS).fit(resumed, loader, ckpt_path=path)
    return {"params": params_of(resumed), "checkpoint": path}


def worker_everything(directory: str) -> dict[str, Any]:
    """Every 2-worker check of test_strategy.py in one job, one after another: a worker's torch and
    Lightning imports cost more than most of these trainings, so the module starts workers once."""
    return {"equivalence": worker_equivalence_runs(), "metrics": worker_metrics(), "refit": worker_refit(),
            "resume": worker_checkpoint_resume(directory)}
