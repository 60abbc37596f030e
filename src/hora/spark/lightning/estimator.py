"""``hora.spark.lightning.TorchEstimator``: a PyTorch Lightning module trained on a Spark DataFrame.

horovod.spark.lightning's estimator. ``fit(df)`` (see :mod:`hora.spark.common.estimator`) checks the
columns, writes the DataFrame once as Parquet into the store and trains on ``num_proc`` Spark tasks;
in each task a Lightning ``Trainer(strategy=HoraStrategy())`` runs the module's own
``training_step``/``validation_step``/``configure_optimizers``, so gradients are averaged across the
tasks, rank 0's initial weights are broadcast, and ``self.log(..., sync_dist=True)`` metrics are
reduced over them. Each task reads its share of the Parquet row groups (:class:`ParquetShardReader`)
and every task takes the same number of batches per epoch (``train_steps_per_epoch``, by default the
training rows divided by ``batch_size`` times ``num_proc``), as the collectives need.

A batch reaches ``training_step`` as Horovod's does: a dict of column name to tensor (features
reshaped by ``input_shapes``; integer columns as int64, others as float32). The history
(``getHistory()``) holds, per epoch, every scalar in the Trainer's ``callback_metrics`` at the end of
the epoch (what the module logged for training and validation), averaged over the tasks. Rank 0
writes a checkpoint into the store after every epoch (``<runs>/<run_id>/checkpoint``), in Lightning's
format (``Module.load_from_checkpoint`` reads its ``state_dict``).

The returned :class:`TorchModel` is :class:`hora.spark.torch.TorchModel`'s: ``transform(df)`` calls
the module on the feature columns (its ``forward``) in Spark's executors and adds ``<label>__output``.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import lightning
import lightning.pytorch as pl
import torch

from hora.errors import ConfigError
from hora.spark.common.estimator import HoraEstimator, TrainingJob
from hora.spark.common.params import _param, install_accessors
from hora.spark.torch.estimator import TorchModel as _TorchModel, _tensors

logger = logging.getLogger(__name__)

# Trainer arguments the estimator sets itself: from its own params, or because the data feed needs them.
_OWNED_TRAINER_ARGS = ("strategy", "max_epochs", "limit_train_batches", "limit_val_batches", "callbacks",
                       "num_sanity_val_steps", "use_distributed_sampler")


@install_accessors
class TorchEstimator(HoraEstimator):
    """Train a ``lightning.pytorch.LightningModule`` on a DataFrame (horovod.spark.lightning.TorchEstimator).

    ``model`` defines ``training_step`` (and ``validation_step`` to be validated),
    ``configure_optimizers`` and a ``forward`` taking one tensor per feature column (what
    ``transform`` calls). ``callbacks`` are Lightning callbacks, ``trainer_args`` further ``Trainer``
    keyword arguments (``accelerator``, ``precision``, ``gradient_clip_val``...). ``optimizer``,
    ``loss`` and ``metrics`` belong to the module here (``configure_optimizers``, ``self.log``), so
    they are refused rather than silently ignored.
    """

    trainer_args = _param("trainer_args", "further keyword arguments for the Lightning Trainer (a dict)")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._setDefault(trainer_args=None)
        unknown = sorted(set(kwargs) - {p.name for p in self.params})
        if unknown:
            raise ConfigError(f"TorchEstimator: unknown parameter(s) {', '.join(unknown)}; see explainParams()")
        self._set(**kwargs)

    def _check_params(self, schema: Any) -> None:
        model = self.getOrDefault(self.model)
        if not isinstance(model, pl.LightningModule):
            raise ConfigError("hora.spark.lightning.TorchEstimator: model must be a lightning.pytorch.LightningModule, "
                              f"got {type(model).__name__} (a plain torch.nn.Module trains with "
                              "hora.spark.torch.TorchEstimator)")
        for method in ("training_step", "configure_optimizers"):
            if getattr(type(model), method) is getattr(pl.LightningModule, method):
                raise ConfigError(f"hora.spark.lightning.TorchEstimator: {type(model).__name__} does not define "
                                  f"{method}()")
        for name, hint in (("optimizer", "return it from configure_optimizers()"),
                           ("loss", "compute it in training_step()"),
                           ("metrics", "log them with self.log(..., sync_dist=True)")):
            if self.getOrDefault(getattr(self, name)):
                raise ConfigError(f"hora.spark.lightning.TorchEstimator: the LightningModule owns its {name}; "
                                  f"{hint} instead of passing {name}=")
        extra = self.getOrDefault(self.trainer_args) or {}
        if not isinstance(extra, dict):
            raise ConfigError(f"hora.spark.lightning.TorchEstimator: trainer_args must be a dict, got "
                              f"{type(extra).__name__}")
        owned = sorted(set(extra) & set(_OWNED_TRAINER_ARGS))
        if owned:
            raise ConfigError(f"hora.spark.lightning.TorchEstimator: trainer_args may not set {', '.join(owned)}: "
                              "the estimator sets them (epochs, train_steps_per_epoch, callbacks...)")
        shapes = self.getOrDefault(self.input_shapes)
        features = self.getOrDefault(self.feature_cols)
        if shapes is not None and len(shapes) != len(features):
            raise ConfigError(f"hora.spark.lightning.TorchEstimator: input_shapes has {len(shapes)} shape(s) for "
                              f"{len(features)} feature column(s)")

    def _training_function(self, job: TrainingJob) -> Callable[[], Any]:
        return _LightningTask(job, cloudpickle.dumps(self.getOrDefault(self.model)),
                              list(self.getOrDefault(self.callbacks) or []),
                              dict(self.getOrDefault(self.trainer_args) or {}))

    def _model(self, trained: Any, history: dict, job: TrainingJob) -> TorchModel:
        return TorchModel(history=history, model=trained, feature_columns=job.feature_cols,
                          label_columns=job.label_cols, run_id=job.run_id, input_shapes=job.input_shapes)


@install_accessors
class TorchModel(_TorchModel):
    """A trained LightningModule that predicts in Spark (horovod.spark.lightning.TorchModel).

    Everything is :class:`hora.spark.torch.TorchModel`'s: ``transform`` calls the module's
    ``forward`` on the feature columns in the executors; ``getModel()`` is the LightningModule."""


class _LightningTask:
    """What every Spark task runs (picklable; everything it needs is in it)."""

    def __init__(self, job: TrainingJob, model_blob: bytes, callbacks: list[Any], trainer_args: dict[str, Any]) -> None:
        self.job = job
        self.model_blob = model_blob
        self.callbacks = callbacks
        self.trainer_args = trainer_args

    def __call__(self) -> Any:
        import warnings

        import hora.torch as hvd
        from hora.lightning import HoraStrategy
        from hora.spark.common.data import ParquetShardReader, steps_per_epoch

        job = self.job
        hvd.init()
        if job.seed is not None:
            torch.manual_seed(job.seed)
        module = cloudpickle.loads(self.model_blob)
        info = job.info
        columns = job.feature_cols + job.label_cols + ([job.sample_weight_col] if job.sample_weight_col else [])
        seed = job.seed if job.seed is not None else 0
        train_reader = ParquetShardReader(info.train_path, job.store.filesystem, hvd.rank(), hvd.size(), columns,
                                          job.batch_size,
                                          shuffle_buffer_size=job.shuffle_buffer_size or 4 * job.batch_size,
                                          seed=seed, shuffle=job.shuffle)
        train_steps = job.train_steps_per_epoch or steps_per_epoch(info.train_rows, job.batch_size, hvd.size())
        train = _loader(_ShardBatches(train_reader, train_steps, job))
        val, val_steps = None, 0
        if info.val_path is not None and info.val_rows:
            val_reader = ParquetShardReader(info.val_path, job.store.filesystem, hvd.rank(), hvd.size(), columns,
                                            job.val_batch_size, shuffle=False, seed=seed)
            val_steps = job.validation_steps_per_epoch or steps_per_epoch(info.val_rows, job.val_batch_size,
                                                                          hvd.size())
            val = _loader(_ShardBatches(val_reader, val_steps, job))
        history = _History(job)
        options: dict[str, Any] = dict(accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                                       enable_progress_bar=False, enable_model_summary=False)
        options.update(self.trainer_args)
        trainer = pl.Trainer(strategy=HoraStrategy(), max_epochs=job.epochs, limit_train_batches=train_steps,
                             limit_val_batches=val_steps, num_sanity_val_steps=0,
                             callbacks=[history, *self.callbacks], **options)
        with warnings.catch_warnings():
            # Lightning's advice about DataLoader workers and IterableDataset lengths does not apply:
            # the batches are read in this process, and the stream must stay in it across epochs.
            warnings.filterwarnings("ignore", message=r".*(does not have many workers|has `__len__` defined).*")
            trainer.fit(module, train, val)
        return (module, history.history) if hvd.rank() == 0 else (None, history.history)


def _loader(dataset: torch.utils.data.IterableDataset) -> torch.utils.data.DataLoader:
    # batch_size=None: the dataset yields whole batches; no workers: the reader's stream lives here.
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)


class _ShardBatches(torch.utils.data.IterableDataset):
    """``steps`` batches per pass from one rank's endless Parquet stream.

    Each pass (each epoch, for Lightning) continues the stream where the last one stopped, as the
    plain TorchEstimator's loop does, so successive epochs see successive rows. It is an
    IterableDataset, so Lightning adds no sampler: the rank's share comes from the reader.
    """

    def __init__(self, reader: Any, steps: int, job: TrainingJob) -> None:
        super().__init__()
        self.reader, self.steps, self.job = reader, int(steps), job
        self._stream: Any = None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._stream is None:
            self._stream = iter(self.reader)
        job = self.job
        others = job.label_cols + ([job.sample_weight_col] if job.sample_weight_col else [])
        for _ in range(self.steps):
            batch = next(self._stream)
            if job.transformation_fn is not None:
                batch = job.transformation_fn(batch)
            tensors = _tensors(batch, job.feature_cols, job.input_shapes)
            tensors += _tensors(batch, others, None, for_labels=True)
            yield dict(zip(job.feature_cols + others, tensors))


class _History(pl.Callback):
    """Per-epoch ``callback_metrics`` averaged over the ranks, the checkpoint, the verbose line.

    At ``on_train_epoch_end`` the epoch's validation has run and its epoch-level training metrics
    are computed. Metrics logged without ``sync_dist`` differ between ranks; averaging every one
    here gives the same history whatever the module asked for (synced ones are equal already).
    Names are rank 0's, so every rank reduces the same list.
    """

    def __init__(self, job: TrainingJob) -> None:
        self.job = job
        self.history: dict[str, list[float]] = {}
        self._began = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._began = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        import hora.torch as hvd

        mine = {name: float(value) for name, value in trainer.callback_metrics.items()
                if not isinstance(value, torch.Tensor) or value.numel() == 1}
        names = hvd.broadcast_object(sorted(mine), root_rank=0, name="hora.spark.lightning.metric_names")
        record: dict[str, float] = {}
        if names:
            values = torch.tensor([mine.get(name, float("nan")) for name in names], dtype=torch.float64)
            averaged = hvd.allreduce(values, op=hvd.Average, name="hora.spark.lightning.metrics")
            record = {name: float(value) for name, value in zip(names, averaged)}
        for name, value in record.items():
            self.history.setdefault(name, []).append(value)
        job = self.job
        if trainer.is_global_zero and job.store.saving_runs():
            self._checkpoint(trainer, module)
        if trainer.is_global_zero and job.verbose:
            shown = ", ".join(f"{name} {value:.4f}" for name, value in record.items())
            print(f"epoch {trainer.current_epoch + 1}/{job.epochs}: {shown} "
                  f"({time.perf_counter() - self._began:.1f} s)", flush=True)

    def _checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Rank 0 alone writes (``trainer.save_checkpoint`` would wait at a barrier for the others),
        through the store, so HDFS and DBFS stores work as local ones do."""
        buffer = io.BytesIO()
        torch.save({"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                    "pytorch-lightning_version": lightning.__version__, "state_dict": module.state_dict(),
                    "optimizer_states": [optimizer.state_dict() for optimizer in trainer.optimizers]}, buffer)
        store = self.job.store
        store.write(f"{store.get_checkpoint_path(self.job.run_id)}/{store.get_checkpoint_filename()}",
                    buffer.getvalue())
