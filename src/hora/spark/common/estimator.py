"""What every hora Spark Estimator does on ``fit``, and how every fitted Model saves and loads.

``fit(df)`` (Spark ML calls ``_fit``):

1. checks the DataFrame against the columns before anything starts (:func:`data.check_and_describe`:
   a missing column, a string label, an empty DataFrame each fail at once, naming the problem);
2. writes it once to Parquet in the store under a dataset index of this fit's own, so two
   estimators sharing a store and ``run_id`` never read each other's rows;
3. runs the framework's training function on ``num_proc`` Spark tasks through :func:`hora.spark.run`
   (each reads its share of the row groups with pyarrow through a shuffle buffer);
4. removes the Parquet copy unless ``keep_intermediate_data``, writes the per-epoch history to the
   run's logs in the store (``<runs>/<run_id>/logs/history.json``), and returns the framework's
   Model, which carries the trained model and that history (``getHistory()``).

Models persist with Spark ML's ``write().save(path)`` / ``Model.load(path)``: Spark's own metadata
file (class, uid, the JSON-able params) and the pickled model and history beside it, written
through Spark, so any path Spark can write (local, HDFS, DBFS) works.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import cloudpickle
from pyspark.ml import Estimator, Model
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from hora.errors import ConfigError
from hora.spark.common import data as spark_data
from hora.spark.common.params import EstimatorParams, ModelParams
from hora.spark.common.store import Store

logger = logging.getLogger(__name__)

# Params a saved model keeps in Spark's metadata file (the rest is pickled beside it).
_JSON_PARAMS = ("feature_columns", "label_columns", "output_cols", "run_id", "input_shapes")


class HoraEstimator(Estimator, EstimatorParams):
    """The framework-neutral part of ``fit``; subclasses give the training function and the Model."""

    def _check_params(self, schema: Any) -> None:
        """Framework checks (a model, an optimizer, a loss...), before any data is written."""
        raise NotImplementedError

    def _training_function(self, job: TrainingJob) -> Callable[[], Any]:
        """What every task runs: trains on its share and returns, on rank 0, ``(history, model)``."""
        raise NotImplementedError

    def _model(self, trained: Any, history: dict, job: TrainingJob) -> Model:
        raise NotImplementedError

    def _fit(self, df: Any) -> Model:
        from hora.spark.runner import run, task_slots

        owner = type(self).__name__
        feature_cols = self.getOrDefault(self.feature_cols)
        label_cols = self.getOrDefault(self.label_cols)
        if not feature_cols or not label_cols:
            raise ConfigError(f"{owner}: give feature_cols and label_cols")
        store = self.getOrDefault(self.store)
        if store is None:
            raise ConfigError(f"{owner}: give store=Store.create(path): where the training data and checkpoints go")
        if isinstance(store, str):
            store = Store.create(store)
        epochs = self.getOrDefault(self.epochs)
        batch_size = self.getOrDefault(self.batch_size)
        if epochs < 1 or batch_size < 1:
            raise ConfigError(f"{owner}: epochs and batch_size must be positive (got {epochs}, {batch_size})")
        validation = self.getOrDefault(self.validation)
        schema = spark_data.check_and_describe(df, feature_cols, label_cols,
                                               self.getOrDefault(self.sample_weight_col), validation)
        self._check_params(schema)
        sc = df.sparkSession.sparkContext
        num_proc = self.getOrDefault(self.num_proc) or task_slots(sc)
        run_id = self.getOrDefault(self.run_id) or f"hora_{uuid.uuid4().hex[:12]}"
        seed = self.getOrDefault(self.random_seed)
        index = store.new_dataset_index()
        info = spark_data.write_training_data(
            store, df, schema, validation, index,
            num_partitions=num_proc * self.getOrDefault(self.partitions_per_process),
            random_seed=seed if seed is not None else 0)
        job = TrainingJob(store=store, info=info, run_id=run_id, num_proc=num_proc, epochs=epochs,
                          batch_size=batch_size, seed=seed, verbose=self.getOrDefault(self.verbose),
                          params=self)
        try:
            results = run(self._training_function(job), num_proc=num_proc, verbose=job.verbose)
        finally:
            if not self.getOrDefault(self.keep_intermediate_data):
                store.remove_data(index)
        trained, history = results[0]
        _write_history(store, run_id, history)
        return self._model(trained, history, job)


def _write_history(store: Store, run_id: str, history: dict) -> None:
    """The run's per-epoch metrics as JSON in its logs folder of the store (when the store keeps
    runs), beside the checkpoints: what ``getHistory()`` returns, readable without Spark."""
    import json

    if not store.saving_runs():
        return
    try:
        text = json.dumps({name: [float(v) for v in values] for name, values in history.items()}, indent=1)
    except (TypeError, ValueError) as exc:  # a framework metric that is not a number: keep the fit
        logger.warning("the history of run %s was not written to the store: %s", run_id, exc)
        return
    store.write_text(f"{store.get_logs_path(run_id)}/history.json", text)


class TrainingJob:
    """One fit's settings, as the training function needs them (pickled to every task)."""

    def __init__(self, store: Store, info: Any, run_id: str, num_proc: int, epochs: int, batch_size: int,
                 seed: int | None, verbose: int, params: EstimatorParams) -> None:
        self.store = store
        self.info = info
        self.run_id = run_id
        self.num_proc = num_proc
        self.epochs = epochs
        self.batch_size = batch_size
        self.val_batch_size = params.getOrDefault(params.val_batch_size) or batch_size
        self.seed = seed
        self.verbose = verbose
        self.feature_cols = list(params.getOrDefault(params.feature_cols))
        self.label_cols = list(params.getOrDefault(params.label_cols))
        self.sample_weight_col = params.getOrDefault(params.sample_weight_col)
        self.input_shapes = params.getOrDefault(params.input_shapes)
        self.shuffle = params.getOrDefault(params.shuffle)
        self.shuffle_buffer_size = params.getOrDefault(params.shuffle_buffer_size)
        self.train_steps_per_epoch = params.getOrDefault(params.train_steps_per_epoch)
        self.validation_steps_per_epoch = params.getOrDefault(params.validation_steps_per_epoch)
        self.transformation_fn = params.getOrDefault(params.transformation_fn)


class HoraModel(Model, ModelParams, MLWritable, MLReadable):
    """The framework-neutral part of a fitted model: params, history and persistence."""

    def write(self) -> MLWriter:
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _ModelReader(cls)

    def _payload(self) -> dict[str, Any]:
        """What is pickled beside the metadata (the framework may add to it)."""
        return {"model": self.getOrDefault(self.model), "history": self.getOrDefault(self.history)}

    def _restore(self, payload: dict[str, Any]) -> None:
        self._set(model=payload["model"], history=payload["history"])


def import_path() -> list[str]:
    """This process's import path, for code that unpickles the user's classes in an executor
    (a model class defined in the driver's script or package must import there too)."""
    import sys

    return [entry for entry in sys.path if isinstance(entry, str)]


def extend_import_path(entries: list[str]) -> None:
    """Add the driver's import path (from :func:`import_path`) after this process's own; entries
    missing on this machine change nothing."""
    import sys

    for entry in entries:
        if entry not in sys.path:
            sys.path.append(entry)


class _ModelWriter(MLWriter):
    def __init__(self, instance: HoraModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:  # Spark ML's naming
        params = {name: self.instance.getOrDefault(getattr(self.instance, name)) for name in _JSON_PARAMS}
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc, paramMap=params)
        blob = cloudpickle.dumps(self.instance._payload())
        self.sc.parallelize([blob], 1).saveAsPickleFile(f"{path}/model")


class _ModelReader(MLReader):
    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> HoraModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sc)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        for name, value in metadata["paramMap"].items():
            instance._set(**{name: value})
        blobs = self.sc.pickleFile(f"{path}/model").collect()
        if len(blobs) != 1:
            raise ConfigError(f"{path}: not a saved hora model (found {len(blobs)} model payloads)")
        instance._restore(cloudpickle.loads(blobs[0]))
        return instance
