"""``hora.spark.keras.KerasEstimator`` and ``KerasModel``: a Keras 3 model trained on a Spark DataFrame.

horovod.spark.keras's classes with its main parameters, on the framework-neutral ``fit`` of
:mod:`hora.spark.common.estimator` (checks, one Parquet copy in the store, ``hora.spark.run``).

How the model gets to the tasks: Keras objects hold backend variables (TensorFlow resources on
the TensorFlow backend), which do not pickle reliably and would carry one process's graph state
into another. So nothing live travels: the model goes as the bytes of a ``.keras`` file (its
architecture as Keras' JSON config plus its weights), the optimizer as its Keras config, Keras
losses and metrics as their Keras configs (names stay names; plain functions, callbacks and
``custom_objects`` are pickled with cloudpickle, as Python code and not TensorFlow state). Each
task rebuilds the model from those, compiles it with ``hora.keras.DistributedOptimizer`` around a
fresh optimizer, and ``model.fit`` trains epoch by epoch on ``train_steps_per_epoch`` batches of
its share of the Parquet row groups (a Python generator over :class:`ParquetShardReader`),
validating likewise. ``BroadcastGlobalVariablesCallback(0)`` starts every rank from rank 0's
weights and optimizer state, ``MetricAverageCallback`` makes each epoch's logged loss and metrics
(``val_`` ones included) the average over the ranks, so the history and the user's callbacks see
global values. Rank 0 writes a ``.keras`` checkpoint into the store after every epoch and returns
the trained model's bytes.

The returned :class:`KerasModel` holds a live Keras model (``getModel()``), predicts in Spark's
executors (``transform(df)`` adds ``<label>__output`` columns through ``mapInArrow``) and saves
and loads with Spark ML persistence, pickling the model's ``.keras`` bytes, never the live model.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import cloudpickle
import numpy as np

from hora.errors import ConfigError
from hora.spark.common.estimator import HoraEstimator, HoraModel, TrainingJob, extend_import_path, import_path
from hora.spark.common.params import _param, install_accessors

logger = logging.getLogger(__name__)

# Rows the executors feed the network at once in ``transform`` (bounds the memory of one call).
_PREDICT_ROWS = 1024


# -- moving Keras objects between processes -------------------------------------------------------


def _model_to_bytes(model: Any) -> bytes:
    """The model as the bytes of a ``.keras`` file: Keras' own format (JSON config, weights as
    arrays, compile settings), so no backend object is pickled and any process with Keras (and
    the model's custom objects) rebuilds it. Keras writes the format to a path, hence the file."""
    with tempfile.TemporaryDirectory(prefix="hora-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as source:
            return source.read()


def _model_from_bytes(blob: bytes, custom_objects: Mapping[str, Any] | None = None, compile: bool = False) -> Any:
    """A live Keras model from :func:`_model_to_bytes`' bytes.

    ``safe_mode=False`` lets ``Lambda`` layers load: the bytes are the user's own model, and a
    saved hora model is a pickle anyway, so Keras' safe mode would protect nothing here.
    """
    import keras

    with tempfile.TemporaryDirectory(prefix="hora-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as target:
            target.write(blob)
        return keras.saving.load_model(path, custom_objects=dict(custom_objects or {}), compile=compile,
                                       safe_mode=False)


def _live_model(blob: bytes, custom_objects: Mapping[str, Any] | None) -> Any:
    """The trained model for the driver, compiled as it was trained (so ``evaluate`` works) where
    its loss and metrics can be rebuilt here; otherwise uncompiled, with a warning saying why."""
    try:
        return _model_from_bytes(blob, custom_objects, compile=True)
    except Exception as exc:  # a custom loss or metric missing from custom_objects
        logger.warning("KerasModel: the model's compile settings could not be restored (%s: %s); it is returned "
                       "uncompiled (pass its custom losses and metrics in custom_objects to keep them)",
                       type(exc).__name__, exc)
        return _model_from_bytes(blob, custom_objects, compile=False)


def _encode(value: Any, what: str) -> tuple[str, Any]:
    """A loss or metric (or a list or dict of them) in a form safe to pickle: names as they are,
    Keras ``Loss``/``Metric`` objects as their Keras config (a metric holds backend variables),
    plain functions pickled as code."""
    import keras

    if value is None:
        return ("none", None)
    if isinstance(value, str):
        return ("name", value)
    if isinstance(value, (list, tuple)):
        return ("list", [_encode(item, what) for item in value])
    if isinstance(value, dict):
        return ("dict", {key: _encode(item, what) for key, item in value.items()})
    if isinstance(value, (keras.losses.Loss, keras.metrics.Metric)):
        try:
            config = keras.saving.serialize_keras_object(value)
            json.dumps(config)
            return ("keras", config)
        except Exception as exc:  # a custom class without a usable get_config
            if isinstance(value, keras.metrics.Metric):
                raise ConfigError(f"KerasEstimator: {what} {type(value).__name__} cannot be serialized by Keras "
                                  f"({exc}); give the class a get_config(), or pass the metric by name") from None
            # A Loss holds no backend state: it can travel as the Python object it is.
    if callable(value):
        try:
            return ("pickle", cloudpickle.dumps(value))
        except Exception as exc:
            raise ConfigError(f"KerasEstimator: {what} {value!r} cannot be pickled ({exc})") from None
    raise ConfigError(f"KerasEstimator: {what} must be a name, a Keras object or a function, "
                      f"got {type(value).__name__}")


def _decode(encoded: tuple[str, Any], custom_objects: Mapping[str, Any]) -> Any:
    """The live object :func:`_encode` described (built in the process that uses it)."""
    import keras

    kind, value = encoded
    if kind == "none":
        return None
    if kind == "name":
        return value
    if kind == "list":
        return [_decode(item, custom_objects) for item in value]
    if kind == "dict":
        return {key: _decode(item, custom_objects) for key, item in value.items()}
    if kind == "keras":
        return keras.saving.deserialize_keras_object(value, custom_objects=dict(custom_objects))
    return cloudpickle.loads(value)


def _limit_threads() -> None:
    """Give TensorFlow as many threads as the Spark task has CPUs (``spark.task.cpus``, 1 by
    default): several tasks share an executor's cores, and TensorFlow's default of one thread
    per core in each would oversubscribe them. A reused Python worker whose TensorFlow already
    started keeps the setting it has (TensorFlow cannot change it then)."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    threads = 1
    try:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None:
            threads = max(1, int(context.cpus()))
    except Exception:  # outside a Spark task, or an old PySpark
        pass
    for setter in (tf.config.threading.set_inter_op_parallelism_threads,
                   tf.config.threading.set_intra_op_parallelism_threads):
        try:
            setter(threads)
        except RuntimeError:
            pass  # TensorFlow already initialised in this process


def _quiet_tensorflow() -> None:
    """TensorFlow's C++ start-up chatter would go to every executor's log on each first import."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# -- batches for Keras -------------------------------------------------------------------------


def _batch_shape(shape: Sequence[Any]) -> tuple[int, ...]:
    """``input_shapes`` entry as a reshape target: a leading -1 (or None) is the batch axis,
    otherwise the shape is one row's and the batch axis is put in front."""
    dims = [-1 if d is None else int(d) for d in shape]
    if dims and dims[0] == -1:
        return tuple(dims)
    return (-1, *dims)


def _array(values: Any, dtype: str | None, shape: Sequence[Any] | None) -> np.ndarray:
    """One column of a batch as the model takes it: stacked, reshaped, in the input's dtype
    (floats and booleans as float32 where the model does not say)."""
    array = np.asarray(values)
    if array.dtype == object:  # Arrow lists in transform arrive as an array of arrays
        array = np.stack(list(array)) if len(array) else array.astype(np.float64)
    if shape is not None:
        array = array.reshape(_batch_shape(shape))
    if dtype is not None:
        return array.astype(dtype, copy=False)
    if np.issubdtype(array.dtype, np.floating) or array.dtype == np.bool_:
        return array.astype(np.float32, copy=False)
    return array


def _inputs(batch: Mapping[str, Any], columns: Sequence[str], shapes: Sequence[Any] | None,
            dtypes: Sequence[str | None]) -> Any:
    """The model's input: one array, or a tuple of them (one per feature column, in order)."""
    arrays = tuple(_array(batch[column], dtypes[i], shapes[i] if shapes is not None else None)
                   for i, column in enumerate(columns))
    return arrays[0] if len(arrays) == 1 else arrays


def _input_dtypes(model: Any, count: int) -> list[str | None]:
    """The dtype of each of the model's inputs, where the model declares them (functional and
    Sequential models with an ``Input``); None where it does not (a subclassed model)."""
    import keras

    try:
        inputs = list(model.inputs or [])
    except (AttributeError, ValueError):
        inputs = []
    if len(inputs) != count:
        return [None] * count
    return [keras.backend.standardize_dtype(tensor.dtype) for tensor in inputs]


def _keras_batches(reader: Any, job: TrainingJob, dtypes: Sequence[str | None]) -> Iterator[tuple]:
    """Endless ``(x, y)`` (or ``(x, y, sample_weight)``) batches from a rank's Parquet share, what
    ``model.fit`` takes from a generator; ``fit`` takes ``steps_per_epoch`` of them per epoch."""
    for batch in reader:
        if job.transformation_fn is not None:
            batch = job.transformation_fn(batch)
        x = _inputs(batch, job.feature_cols, job.input_shapes, dtypes)
        labels = tuple(_array(batch[column], None, None) for column in job.label_cols)
        y = labels[0] if len(labels) == 1 else labels
        if job.sample_weight_col:
            yield x, y, np.asarray(batch[job.sample_weight_col], dtype=np.float32)
        else:
            yield x, y


# -- the estimator ---------------------------------------------------------------------------------


@install_accessors
class KerasEstimator(HoraEstimator):
    """Train a Keras 3 model on a DataFrame (horovod.spark.keras.KerasEstimator).

    ``model`` is a ``keras.Model`` (compiled or not; give it an ``Input`` so its weights exist and
    every rank starts from the same ones), fed one array per feature column in order, shaped by
    ``input_shapes`` when given (``[[-1, 8, 8, 1]]``, or one row's shape ``[[8, 8, 1]]``), and
    fitted to one output per label column. ``optimizer`` is a Keras optimizer (default: the
    compiled model's); its learning rate is used as given (scale it by ``num_proc`` yourself, as
    in Horovod). ``loss`` is a name, a ``keras.losses.Loss`` or a function (default: the compiled
    model's), or a list/dict of them for several outputs, weighted by ``loss_weights``.
    ``metrics`` are names, ``keras.metrics.Metric`` objects or functions, reported per epoch under
    Keras' names (``val_`` ones for validation). ``callbacks`` are Keras callbacks passed to
    ``model.fit`` on every rank (they see metrics averaged over the ranks). ``custom_objects``
    names the custom layers, losses and metrics the model needs to load (in the tasks, and when a
    saved model is loaded). ``gradient_compression``: ``hora.keras.Compression.fp16`` to halve
    the allreduce traffic.
    """

    custom_objects = _param("custom_objects", "custom Keras objects (layers, losses, metrics) by name, for loading")
    loss_weights = _param("loss_weights", "weights of the losses when the model has several outputs")
    gradient_compression = _param("gradient_compression", "gradient compression (hora.keras.Compression.fp16)")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._setDefault(custom_objects=None, loss_weights=None, gradient_compression=None)
        unknown = sorted(set(kwargs) - {p.name for p in self.params})
        if unknown:
            raise ConfigError(f"KerasEstimator: unknown parameter(s) {', '.join(unknown)}; see explainParams()")
        self._set(**kwargs)
        self._spec: _KerasSpec | None = None

    def _check_params(self, schema: Any) -> None:
        """Check the Keras side and serialize everything the tasks need now, so a model, loss or
        callback that cannot travel fails before the DataFrame is written or a task starts."""
        self._spec = self._build_spec()

    def _build_spec(self) -> _KerasSpec:
        import keras

        model = self.getOrDefault(self.model)
        if not isinstance(model, keras.Model):
            raise ConfigError(f"KerasEstimator: model must be a keras.Model, got {type(model).__name__}")
        compiled = bool(getattr(model, "compiled", False))
        optimizer = self.getOrDefault(self.optimizer)
        if optimizer is None and compiled:
            optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ConfigError("KerasEstimator: optimizer must be a Keras optimizer (keras.optimizers.Adam(...)), got "
                              f"{type(optimizer).__name__}")
        loss = self.getOrDefault(self.loss)
        if loss is None and compiled:
            loss = getattr(model, "loss", None)
        if loss is None:
            raise ConfigError("KerasEstimator: give loss (or a model compiled with one)")
        features = list(self.getOrDefault(self.feature_cols))
        shapes = self.getOrDefault(self.input_shapes)
        if shapes is not None and len(shapes) != len(features):
            raise ConfigError(f"KerasEstimator: input_shapes has {len(shapes)} shape(s) for {len(features)} feature "
                              "column(s)")
        try:
            inputs = len(model.inputs or [])
        except (AttributeError, ValueError):
            inputs = 0
        if inputs and inputs != len(features):
            raise ConfigError(f"KerasEstimator: the model takes {inputs} input(s) but feature_cols names "
                              f"{len(features)} column(s): {features}")
        callbacks = list(self.getOrDefault(self.callbacks) or [])
        for callback in callbacks:
            if not isinstance(callback, keras.callbacks.Callback):
                raise ConfigError(f"KerasEstimator: callbacks must be keras.callbacks.Callback objects, got "
                                  f"{type(callback).__name__}")
        try:
            callbacks_blob = cloudpickle.dumps(callbacks)
        except Exception as exc:
            raise ConfigError(f"KerasEstimator: the callbacks cannot be sent to the tasks ({exc}); build them "
                              "without references to models or tensors") from None
        custom = self.getOrDefault(self.custom_objects) or {}
        if not isinstance(custom, Mapping):
            raise ConfigError(f"KerasEstimator: custom_objects must be a dict of name to class or function, "
                              f"got {type(custom).__name__}")
        try:
            custom_blob = cloudpickle.dumps(dict(custom))
        except Exception as exc:
            raise ConfigError(f"KerasEstimator: custom_objects cannot be pickled ({exc})") from None
        try:
            model_bytes = _model_to_bytes(model)
        except Exception as exc:
            raise ConfigError(f"KerasEstimator: Keras cannot save the model ({type(exc).__name__}: {exc}); a "
                              "subclassed model needs get_config() (or register it and pass custom_objects)") from None
        try:
            optimizer_config = keras.optimizers.serialize(optimizer)
            json.dumps(optimizer_config)
        except Exception as exc:
            raise ConfigError(f"KerasEstimator: Keras cannot serialize the optimizer {type(optimizer).__name__} "
                              f"({exc})") from None
        return _KerasSpec(model_bytes=model_bytes, optimizer_config=optimizer_config, loss=_encode(loss, "loss"),
                          loss_weights=self.getOrDefault(self.loss_weights),
                          metrics=_encode(_metric_list(self.getOrDefault(self.metrics)), "metric"),
                          callbacks=callbacks_blob, custom_objects=custom_blob,
                          compression=self.getOrDefault(self.gradient_compression))

    def _training_function(self, job: TrainingJob) -> Callable[[], Any]:
        spec = self._spec if self._spec is not None else self._build_spec()
        self._spec = None  # one fit's bytes are not kept on the estimator
        return _Trainer(job, spec)

    def _model(self, trained: Any, history: dict, job: TrainingJob) -> KerasModel:
        custom = dict(self.getOrDefault(self.custom_objects) or {})
        return KerasModel(history=history, model=_live_model(trained, custom), feature_columns=job.feature_cols,
                          label_columns=job.label_cols, run_id=job.run_id, input_shapes=job.input_shapes,
                          custom_objects=custom or None)


def _metric_list(metrics: Any) -> Any:
    """``metrics`` as ``compile`` takes them: a list, or a list/dict per output as given."""
    if metrics is None:
        return []
    if isinstance(metrics, (list, tuple, dict)):
        return metrics
    return [metrics]


class _KerasSpec:
    """What every task needs besides the :class:`TrainingJob`: bytes and configs only."""

    def __init__(self, model_bytes: bytes, optimizer_config: dict, loss: tuple, loss_weights: Any, metrics: tuple,
                 callbacks: bytes, custom_objects: bytes, compression: Any) -> None:
        self.model_bytes = model_bytes
        self.optimizer_config = optimizer_config
        self.loss = loss
        self.loss_weights = loss_weights
        self.metrics = metrics
        self.callbacks = callbacks
        self.custom_objects = custom_objects
        self.compression = compression


class _Trainer:
    """The function every Spark task runs (picklable; everything it needs is in it)."""

    def __init__(self, job: TrainingJob, spec: _KerasSpec) -> None:
        self.job = job
        self.spec = spec

    def __call__(self) -> Any:
        _quiet_tensorflow()
        import keras

        _limit_threads()  # before any TensorFlow op starts its thread pools
        import hora.keras as hvd

        hvd.init()
        keras.backend.clear_session()  # Spark reuses Python workers: drop the last fit's graphs
        try:
            return self._train(hvd)
        finally:
            keras.backend.clear_session()

    def _train(self, hvd: Any) -> Any:
        import keras

        from hora.spark.common.data import ParquetShardReader, steps_per_epoch

        job, spec = self.job, self.spec
        if job.seed is not None:
            keras.utils.set_random_seed(job.seed)
        custom = cloudpickle.loads(spec.custom_objects)
        model = _model_from_bytes(spec.model_bytes, custom, compile=False)
        optimizer = keras.optimizers.deserialize(spec.optimizer_config, custom_objects=custom)
        compression = spec.compression if spec.compression is not None else hvd.Compression.none
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer, compression=compression),
                      loss=_decode(spec.loss, custom), loss_weights=spec.loss_weights,
                      metrics=_decode(spec.metrics, custom) or None, jit_compile=False)
        rank, size = hvd.rank(), hvd.size()
        info = job.info
        columns = job.feature_cols + job.label_cols + ([job.sample_weight_col] if job.sample_weight_col else [])
        seed = job.seed if job.seed is not None else 0
        dtypes = _input_dtypes(model, len(job.feature_cols))
        train = ParquetShardReader(info.train_path, job.store.filesystem, rank, size, columns, job.batch_size,
                                   shuffle_buffer_size=job.shuffle_buffer_size or 4 * job.batch_size, seed=seed,
                                   shuffle=job.shuffle)
        train_steps = job.train_steps_per_epoch or steps_per_epoch(info.train_rows, job.batch_size, size)
        validation: dict[str, Any] = {}
        if info.val_path is not None and info.val_rows:
            val = ParquetShardReader(info.val_path, job.store.filesystem, rank, size, columns, job.val_batch_size,
                                     shuffle=False, seed=seed)
            validation = dict(validation_data=_keras_batches(val, job, dtypes),
                              validation_steps=job.validation_steps_per_epoch or steps_per_epoch(
                                  info.val_rows, job.val_batch_size, size))
        recorder = _epoch_end_callback(job, rank)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                     *cloudpickle.loads(spec.callbacks), recorder]
        # shuffle=False: the reader already shuffles (row groups per epoch, rows through its buffer).
        model.fit(_keras_batches(train, job, dtypes), steps_per_epoch=train_steps, epochs=job.epochs, shuffle=False,
                  callbacks=callbacks, verbose=2 if rank == 0 and job.verbose >= 2 else 0, **validation)
        history = recorder.history
        return (_model_to_bytes(model), history) if rank == 0 else (None, history)


def _epoch_end_callback(job: TrainingJob, rank: int) -> Any:
    """The last callback of ``fit``: records the (rank-averaged) epoch logs, and on rank 0 writes
    the checkpoint into the store and prints the epoch's line for the driver. Built in the task,
    where Keras is imported."""
    import keras

    class EpochEnd(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.history: dict[str, list[float]] = {}
            self.began = time.perf_counter()

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            record = {}
            for name, value in (logs or {}).items():
                array = np.asarray(keras.ops.convert_to_numpy(value))
                if array.size == 1:
                    record[name] = float(array.reshape(()))
            for name, value in record.items():
                self.history.setdefault(name, []).append(value)
            if rank != 0:
                return
            store = job.store
            if store.saving_runs():
                store.write(f"{store.get_checkpoint_path(job.run_id)}/{store.get_checkpoint_filename()}",
                            _model_to_bytes(self.model))
            if job.verbose:
                shown = ", ".join(f"{name} {value:.4f}" for name, value in record.items())
                print(f"epoch {epoch + 1}/{job.epochs}: {shown} ({time.perf_counter() - self.began:.1f} s)",
                      flush=True)

    return EpochEnd()


# -- the fitted model ------------------------------------------------------------------------------


@install_accessors
class KerasModel(HoraModel):
    """A trained Keras model that predicts in Spark (horovod.spark.keras.KerasModel).

    ``getModel()`` is the live ``keras.Model``. What persists (``write().save``) and what goes to
    the executors in ``transform`` is its ``.keras`` bytes, never the live object.
    """

    custom_objects = _param("custom_objects", "custom Keras objects (layers, losses, metrics) by name, for loading")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._setDefault(custom_objects=None)
        self._set(**kwargs)

    def getModel(self) -> Any:  # Spark ML's naming
        """The trained ``keras.Model``, live in this process (compiled as trained where possible)."""
        return self.getOrDefault(self.model)

    def _custom(self) -> dict[str, Any]:
        return dict(self.getOrDefault(self.custom_objects) or {})

    def _payload(self) -> dict[str, Any]:
        """Bytes and plain data only: the model as ``.keras`` bytes, the history, custom objects
        (classes and functions, pickled by reference or as code)."""
        model = self.getOrDefault(self.model)
        return {"model": None if model is None else _model_to_bytes(model), "history": self.getOrDefault(self.history),
                "custom_objects": self._custom()}

    def _restore(self, payload: dict[str, Any]) -> None:
        custom = dict(payload.get("custom_objects") or {})
        blob = payload["model"]
        self._set(model=None if blob is None else _live_model(blob, custom), history=payload["history"],
                  custom_objects=custom or None)

    def _transform(self, df: Any) -> Any:
        import pyarrow as pa
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

        features = list(self.getOrDefault(self.feature_columns))
        missing = [c for c in features if c not in df.columns]
        if missing:
            raise ConfigError(f"KerasModel.transform: feature column(s) {missing} are not in the DataFrame "
                              f"(columns: {df.columns})")
        model = self.getOrDefault(self.model)
        if model is None:
            raise ConfigError("KerasModel.transform: the KerasModel holds no model")
        outputs = self.getOutputCols()
        shapes = self.getOrDefault(self.input_shapes)
        model_blob = _model_to_bytes(model)
        custom_blob = cloudpickle.dumps(self._custom())
        dtypes = _input_dtypes(model, len(features))
        paths = import_path()
        prepared = df
        vectors = _vector_columns(df, features)
        if vectors:
            from pyspark.ml.functions import vector_to_array

            for column in vectors:
                prepared = prepared.withColumn(column, vector_to_array(column))
        widths = _output_widths(model, prepared, features, shapes, dtypes)
        if len(widths) != len(outputs):
            raise ConfigError(f"KerasModel.transform: the model has {len(widths)} output(s) for {len(outputs)} "
                              f"output column(s) {outputs}")
        fields = [StructField(name, ArrayType(DoubleType()) if width else DoubleType())
                  for name, width in zip(outputs, widths)]
        schema = StructType(prepared.schema.fields + fields)

        def predict(batches: Iterator[Any]) -> Iterator[Any]:
            _quiet_tensorflow()
            extend_import_path(paths)
            _limit_threads()
            live = _model_from_bytes(model_blob, cloudpickle.loads(custom_blob), compile=False)
            for batch in batches:
                columns = {name: batch.column(name).to_numpy(zero_copy_only=False) for name in features}
                if batch.num_rows:
                    results = _predict(live, columns, features, shapes, dtypes, batch.num_rows)
                else:
                    results = [np.zeros((0, max(width, 1))) for width in widths]
                extra = [_arrow_column(array, width) for array, width in zip(results, widths)]
                yield pa.RecordBatch.from_arrays(list(batch.columns) + extra,
                                                 schema=_arrow_schema(batch, outputs, widths))

        return prepared.mapInArrow(predict, schema)


def _predict(model: Any, columns: Mapping[str, Any], features: Sequence[str], shapes: Any,
             dtypes: Sequence[str | None], rows: int) -> list[np.ndarray]:
    """The model's outputs for ``rows`` rows as float64 arrays, one per output, computed
    ``_PREDICT_ROWS`` rows at a time (a direct call: no ``tf.function`` to trace per batch size)."""
    import keras

    pieces: list[list[np.ndarray]] = []
    for start in range(0, max(rows, 1), _PREDICT_ROWS):
        chunk = {name: values[start:start + _PREDICT_ROWS] for name, values in columns.items()}
        result = model(_inputs(chunk, features, shapes, dtypes), training=False)
        results = list(result.values()) if isinstance(result, dict) else \
            list(result) if isinstance(result, (list, tuple)) else [result]
        pieces.append([np.asarray(keras.ops.convert_to_numpy(value), dtype=np.float64) for value in results])
    return [np.concatenate([piece[i] for piece in pieces]) for i in range(len(pieces[0]))]


def _arrow_column(array: np.ndarray, width: int) -> Any:
    """One output as an Arrow column: a double per row, or a list of doubles per row (built from
    offsets over the flat values, without a Python object per row)."""
    import pyarrow as pa

    if not width:
        return pa.array(array.reshape(-1))
    rows = len(array)
    offsets = np.arange(0, rows * width + 1, width, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(array.reshape(rows * width)))


def _vector_columns(df: Any, columns: Sequence[str]) -> list[str]:
    from pyspark.ml.linalg import VectorUDT

    return [field.name for field in df.schema.fields if field.name in columns and isinstance(field.dataType, VectorUDT)]


def _width(shape: Sequence[Any]) -> int | None:
    """0 for one number per row ((batch,) or (batch, 1)), else the flattened row size; None when
    a dimension is unknown."""
    dims = list(shape)[1:]
    if not dims or dims == [1]:
        return 0
    if any(d is None for d in dims):
        return None
    return int(np.prod(dims))


def _output_widths(model: Any, df: Any, features: Sequence[str], shapes: Any,
                   dtypes: Sequence[str | None]) -> list[int]:
    """Per output: 0 for one number per row, else the row's width; from the model's declared
    outputs, or (a subclassed model, an unknown dimension) from a prediction on the first row."""
    try:
        declared = [_width(tensor.shape) for tensor in (model.outputs or [])]
    except (AttributeError, ValueError):
        declared = []
    known = [int(width) for width in declared if width is not None]
    if declared and len(known) == len(declared):
        return known
    row = df.select(*features).limit(1).collect()
    if not row:
        return [0]
    columns = {name: np.asarray([row[0][name]]) for name in features}
    return [_width(result.shape) or 0 for result in _predict(model, columns, features, shapes, dtypes, 1)]


def _arrow_schema(batch: Any, outputs: Sequence[str], widths: Sequence[int]) -> Any:
    import pyarrow as pa

    extra = [pa.field(name, pa.list_(pa.float64()) if width else pa.float64()) for name, width in zip(outputs, widths)]
    return pa.schema(list(batch.schema) + extra)
