"""``hora.spark.torch.TorchEstimator`` and ``TorchModel``: a PyTorch model trained on a Spark DataFrame.

horovod.spark.torch's classes with its main parameters. ``fit(df)`` (see
:mod:`hora.spark.common.estimator`) trains on ``num_proc`` Spark tasks, each a hora.torch worker:
``DistributedOptimizer`` averages the gradients, rank 0's weights and optimizer state are broadcast
first, every epoch each rank takes ``train_steps_per_epoch`` batches of its share of the Parquet row
groups, and the loss and metrics are averaged over the ranks (validation likewise). Rank 0 writes a
checkpoint into the store after every epoch (``<runs>/<run_id>/checkpoint``). The model and the
optimizer travel to the tasks in one pickle, so the optimizer still points at the model's
parameters there.

The returned :class:`TorchModel` predicts in Spark's executors (``transform(df)`` adds one column per
label, ``<label>__output`` unless ``output_cols`` says otherwise) and saves and loads with Spark ML
persistence.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from hora.errors import ConfigError
from hora.spark.common.estimator import HoraEstimator, HoraModel, TrainingJob, extend_import_path, import_path
from hora.spark.common.params import _param, install_accessors

logger = logging.getLogger(__name__)


@install_accessors
class TorchEstimator(HoraEstimator):
    """Train a ``torch.nn.Module`` on a DataFrame (horovod.spark.torch.TorchEstimator).

    ``model`` is called as ``model(*features)``, one tensor per feature column, shaped by
    ``input_shapes`` when given (``[[-1, 1, 8, 8]]``...). ``loss(output, label)`` is a torch loss
    (``torch.nn.functional.cross_entropy``, ``torch.nn.MSELoss()``...); with several label columns,
    ``loss`` may be a list, one per label, summed (weighted by ``loss_weights``). ``metrics`` are
    functions ``metric(output, label) -> tensor`` reported per epoch under their ``__name__``.
    """

    loss_weights = _param("loss_weights", "weights of the losses when there are several labels")
    loss_constructors = _param("loss_constructors", "functions that build the loss, one per label (instead of loss)")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._setDefault(loss_weights=None, loss_constructors=None)
        unknown = sorted(set(kwargs) - {p.name for p in self.params})
        if unknown:
            raise ConfigError(f"TorchEstimator: unknown parameter(s) {', '.join(unknown)}; see explainParams()")
        self._set(**kwargs)

    def _check_params(self, schema: Any) -> None:
        import torch

        model = self.getOrDefault(self.model)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"TorchEstimator: model must be a torch.nn.Module, got {type(model).__name__}")
        optimizer = self.getOrDefault(self.optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError("TorchEstimator: optimizer must be a torch.optim.Optimizer built on the model's "
                              f"parameters, got {type(optimizer).__name__}")
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for group in optimizer.param_groups for p in group["params"]):
            raise ConfigError("TorchEstimator: the optimizer holds parameters that are not the model's; build it "
                              "on model.parameters()")
        if self.getOrDefault(self.loss) is None and self.getOrDefault(self.loss_constructors) is None:
            raise ConfigError("TorchEstimator: give loss (or loss_constructors)")
        shapes = self.getOrDefault(self.input_shapes)
        features = self.getOrDefault(self.feature_cols)
        if shapes is not None and len(shapes) != len(features):
            raise ConfigError(f"TorchEstimator: input_shapes has {len(shapes)} shape(s) for {len(features)} feature "
                              "column(s)")

    def _training_function(self, job: TrainingJob) -> Callable[[], Any]:
        spec = _TorchSpec(
            model_and_optimizer=cloudpickle.dumps((self.getOrDefault(self.model), self.getOrDefault(self.optimizer))),
            losses=_losses(self.getOrDefault(self.loss), self.getOrDefault(self.loss_constructors),
                           len(job.label_cols)),
            loss_weights=self.getOrDefault(self.loss_weights),
            metrics=list(self.getOrDefault(self.metrics) or []),
            callbacks=list(self.getOrDefault(self.callbacks) or []),
        )
        return _Trainer(job, spec)

    def _model(self, trained: Any, history: dict, job: TrainingJob) -> TorchModel:
        model = TorchModel(history=history, model=trained, feature_columns=job.feature_cols,
                           label_columns=job.label_cols, run_id=job.run_id, input_shapes=job.input_shapes)
        return model


def _losses(loss: Any, constructors: Any, labels: int) -> list[Any]:
    if constructors is not None:
        built = [make() for make in (constructors if isinstance(constructors, (list, tuple)) else [constructors])]
    else:
        built = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    if len(built) == 1 and labels > 1:
        built = built * labels
    if len(built) != labels:
        raise ConfigError(f"TorchEstimator: {len(built)} loss(es) for {labels} label column(s)")
    return built


class _TorchSpec:
    def __init__(self, model_and_optimizer: bytes, losses: list[Any], loss_weights: Sequence[float] | None,
                 metrics: list[Any], callbacks: list[Any]) -> None:
        self.model_and_optimizer = model_and_optimizer
        self.losses = losses
        self.loss_weights = loss_weights
        self.metrics = metrics
        self.callbacks = callbacks


def _tensors(batch: dict[str, np.ndarray], columns: Sequence[str], shapes: Sequence[Sequence[int]] | None,
             for_labels: bool = False) -> list[Any]:
    import torch

    out = []
    for i, column in enumerate(columns):
        array = np.asarray(batch[column])
        if shapes is not None and not for_labels:
            array = array.reshape(tuple(shapes[i]))
        if np.issubdtype(array.dtype, np.integer):
            out.append(torch.from_numpy(array.astype(np.int64)))
        else:
            out.append(torch.from_numpy(array.astype(np.float32)))
    return out


class _Trainer:
    """The function every Spark task runs (picklable; everything it needs is in it)."""

    def __init__(self, job: TrainingJob, spec: _TorchSpec) -> None:
        self.job = job
        self.spec = spec

    def __call__(self) -> Any:
        import torch

        import hora.torch as hvd
        from hora.spark.common.data import ParquetShardReader, steps_per_epoch

        job, spec = self.job, self.spec
        hvd.init()
        if job.seed is not None:
            torch.manual_seed(job.seed)
        model, optimizer = cloudpickle.loads(spec.model_and_optimizer)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        info = job.info
        columns = job.feature_cols + job.label_cols + ([job.sample_weight_col] if job.sample_weight_col else [])
        seed = job.seed if job.seed is not None else 0
        train = iter(ParquetShardReader(info.train_path, job.store.filesystem, hvd.rank(), hvd.size(), columns,
                                        job.batch_size,
                                        shuffle_buffer_size=job.shuffle_buffer_size or 4 * job.batch_size,
                                        seed=seed, shuffle=job.shuffle))
        train_steps = job.train_steps_per_epoch or steps_per_epoch(info.train_rows, job.batch_size, hvd.size())
        val = None
        if info.val_path is not None and info.val_rows:
            val = iter(ParquetShardReader(info.val_path, job.store.filesystem, hvd.rank(), hvd.size(), columns,
                                          job.val_batch_size, shuffle=False, seed=seed))
            val_steps = job.validation_steps_per_epoch or steps_per_epoch(info.val_rows, job.val_batch_size,
                                                                          hvd.size())
        history: dict[str, list[float]] = {}
        for epoch in range(job.epochs):
            began = time.perf_counter()
            model.train()
            sums = self._epoch(model, optimizer, train, train_steps, training=True)
            record = {name: value for name, value in sums.items()}
            if val is not None:
                model.eval()
                with torch.no_grad():
                    val_sums = self._epoch(model, optimizer, val, val_steps, training=False)
                record.update({f"val_{name}": value for name, value in val_sums.items()})
            for name, value in record.items():
                history.setdefault(name, []).append(value)
            for callback in self.spec.callbacks:
                callback(epoch, dict(record))
            if hvd.rank() == 0 and job.store.saving_runs():
                self._checkpoint(model, optimizer, epoch)
            if hvd.rank() == 0 and job.verbose:
                shown = ", ".join(f"{name} {value:.4f}" for name, value in record.items())
                print(f"epoch {epoch + 1}/{job.epochs}: {shown} ({time.perf_counter() - began:.1f} s)", flush=True)
        return (model, history) if hvd.rank() == 0 else (None, history)

    def _epoch(self, model: Any, optimizer: Any, batches: Any, steps: int, training: bool) -> dict[str, float]:
        import torch

        import hora.torch as hvd

        job, spec = self.job, self.spec
        totals: dict[str, float] = {}
        for _ in range(steps):
            batch = next(batches)
            if job.transformation_fn is not None:
                batch = job.transformation_fn(batch)
            inputs = _tensors(batch, job.feature_cols, job.input_shapes)
            labels = _tensors(batch, job.label_cols, None, for_labels=True)
            if training:
                optimizer.zero_grad()
            outputs = model(*inputs)
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            weights = spec.loss_weights or [1.0] * len(labels)
            loss = sum(w * fn(out, lab) for w, fn, out, lab in zip(weights, spec.losses, outputs, labels))
            if training:
                loss.backward()
                optimizer.step()
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for metric in spec.metrics:
                value = metric(outputs[0].detach(), labels[0])
                name = getattr(metric, "__name__", type(metric).__name__)
                totals[name] = totals.get(name, 0.0) + float(value)
        # The epoch's mean over its steps, averaged over the ranks (every rank took ``steps`` batches).
        names = sorted(totals)
        means = torch.tensor([totals[name] / max(steps, 1) for name in names], dtype=torch.float64)
        averaged = hvd.allreduce(means, op=hvd.Average, name=f"hora.spark.metrics.{'train' if training else 'val'}")
        return {name: float(value) for name, value in zip(names, averaged)}

    def _checkpoint(self, model: Any, optimizer: Any, epoch: int) -> None:
        import torch

        buffer = io.BytesIO()
        torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        store = self.job.store
        store.write(f"{store.get_checkpoint_path(self.job.run_id)}/{store.get_checkpoint_filename()}",
                    buffer.getvalue())


@install_accessors
class TorchModel(HoraModel):
    """A trained PyTorch model that predicts in Spark (horovod.spark.torch.TorchModel)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._set(**kwargs)

    def getModel(self) -> Any:  # Spark ML's naming
        return self.getOrDefault(self.model)

    def _transform(self, df: Any) -> Any:
        import pyarrow as pa
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

        features = list(self.getOrDefault(self.feature_columns))
        missing = [c for c in features if c not in df.columns]
        if missing:
            raise ConfigError(f"TorchModel.transform: feature column(s) {missing} are not in the DataFrame "
                              f"(columns: {df.columns})")
        outputs = self.getOutputCols()
        shapes = self.getOrDefault(self.input_shapes)
        model_blob = cloudpickle.dumps(self.getOrDefault(self.model))
        paths = import_path()
        vectors = _vector_columns(df, features)
        prepared = df
        if vectors:
            from pyspark.ml.functions import vector_to_array

            for column in vectors:
                prepared = prepared.withColumn(column, vector_to_array(column))
        widths = _output_widths(self.getOrDefault(self.model), prepared, features, shapes)
        fields = [StructField(name, ArrayType(DoubleType()) if width else DoubleType())
                  for name, width in zip(outputs, widths)]
        schema = StructType(prepared.schema.fields + fields)

        def predict(batches: Any) -> Any:
            import torch

            extend_import_path(paths)
            model = cloudpickle.loads(model_blob)
            model.eval()
            for batch in batches:
                columns = {name: batch.column(name).to_numpy(zero_copy_only=False) for name in features}
                arrays = {name: np.stack(values) if values.dtype == object else values
                          for name, values in columns.items()}
                with torch.no_grad():
                    result = model(*_tensors(arrays, features, shapes))
                results = list(result) if isinstance(result, (list, tuple)) else [result]
                extra = []
                for value, width in zip(results, widths):
                    array = value.detach().cpu().numpy().astype(np.float64)
                    extra.append(pa.array(list(array.reshape(len(array), -1))) if width
                                 else pa.array(array.reshape(-1)))
                yield pa.RecordBatch.from_arrays(list(batch.columns) + extra,
                                                 schema=_arrow_schema(batch, outputs, widths))

        return prepared.mapInArrow(predict, schema)


def _vector_columns(df: Any, columns: Sequence[str]) -> list[str]:
    from pyspark.ml.linalg import VectorUDT

    return [field.name for field in df.schema.fields if field.name in columns and isinstance(field.dataType, VectorUDT)]


def _output_widths(model: Any, df: Any, features: Sequence[str], shapes: Any) -> list[int]:
    """Per output: 0 for one number per row, else the width (found on the first row)."""
    import torch

    row = df.select(*features).limit(1).collect()
    if not row:
        return [0]
    arrays = {name: np.asarray([row[0][name]]) for name in features}
    model.eval()
    with torch.no_grad():
        result = model(*_tensors(arrays, features, shapes))
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    return [0 if value.dim() <= 1 or value.shape[-1] == 1 and value.dim() == 2 else int(np.prod(value.shape[1:]))
            for value in results]


def _arrow_schema(batch: Any, outputs: Sequence[str], widths: Sequence[int]) -> Any:
    import pyarrow as pa

    extra = [pa.field(name, pa.list_(pa.float64()) if width else pa.float64()) for name, width in zip(outputs, widths)]
    return pa.schema(list(batch.schema) + extra)
