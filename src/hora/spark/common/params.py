"""The Spark ML parameters every hora Estimator and Model shares, with horovod.spark's names.

Spark ML keeps an estimator's settings as ``Param``s: they show in ``explainParams()``, copy with
``copy()``, persist with the model, and are set by keyword in the constructor or with
``setX(...)``/read with ``getX()``. Python objects (a model, an optimizer, a store) travel as
they are (the identity converter); the names and defaults are Horovod's, so a horovod.spark
pipeline keeps working after the import changes.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param.shared import Param, Params, TypeConverters


def _param(name: str, doc: str, converter: Any = TypeConverters.identity) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


class EstimatorParams(Params):
    """What a hora Estimator is fitted with (horovod.spark.common.params.EstimatorParams)."""

    num_proc = _param("num_proc", "number of training processes (default: the cluster's task slots)")
    model = _param("model", "the model to train")
    optimizer = _param("optimizer", "the optimizer (its learning rate is scaled by the caller, as in Horovod)")
    loss = _param("loss", "the loss function")
    metrics = _param("metrics", "metrics reported per epoch, besides the loss")
    feature_cols = _param("feature_cols", "feature column names", TypeConverters.toListString)
    label_cols = _param("label_cols", "label column names", TypeConverters.toListString)
    sample_weight_col = _param("sample_weight_col", "optional column of sample weights")
    input_shapes = _param("input_shapes", "per feature column, the shape of a batch of it ([-1, 1, 8, 8]: -1 for "
                                          "the batch); Keras also takes one row's shape ([1, 8, 8])")
    validation = _param("validation", "a fraction of rows (0-1), or a column whose true rows are for validation")
    batch_size = _param("batch_size", "rows per batch, per process", TypeConverters.toInt)
    val_batch_size = _param("val_batch_size", "rows per validation batch, per process (default: batch_size)")
    epochs = _param("epochs", "epochs to train", TypeConverters.toInt)
    train_steps_per_epoch = _param("train_steps_per_epoch",
                                   "batches per epoch (default: rows / (batch_size x num_proc))")
    validation_steps_per_epoch = _param("validation_steps_per_epoch", "validation batches per epoch")
    callbacks = _param("callbacks", "training callbacks (framework specific)")
    store = _param("store", "where the training data, checkpoints and logs go (hora.spark.common.store.Store)")
    run_id = _param("run_id", "the run's name in the store (default: a fresh one per fit)")
    shuffle = _param("shuffle", "shuffle the training rows each epoch", TypeConverters.toBoolean)
    shuffle_buffer_size = _param("shuffle_buffer_size", "rows the shuffle buffer mixes")
    random_seed = _param("random_seed", "seed of the validation split, the shuffle and the model's start")
    transformation_fn = _param("transformation_fn", "a function applied to each batch (a dict of column arrays)")
    verbose = _param("verbose", "0: quiet, 1: a line per epoch", TypeConverters.toInt)
    partitions_per_process = _param("partitions_per_process", "Parquet partitions written per process",
                                    TypeConverters.toInt)
    keep_intermediate_data = _param("keep_intermediate_data", "keep the Parquet copy of the DataFrame after fit",
                                    TypeConverters.toBoolean)

    def __init__(self) -> None:
        super().__init__()
        # No shared mutable defaults: metrics and callbacks default to None (no metrics, no callbacks).
        self._setDefault(num_proc=None, model=None, optimizer=None, loss=None, metrics=None, feature_cols=None,
                         label_cols=None, sample_weight_col=None, input_shapes=None, validation=None,
                         batch_size=32, val_batch_size=None, epochs=1, train_steps_per_epoch=None,
                         validation_steps_per_epoch=None, callbacks=None, store=None, run_id=None, shuffle=True,
                         shuffle_buffer_size=None, random_seed=None, transformation_fn=None, verbose=1,
                         partitions_per_process=10, keep_intermediate_data=False)


class ModelParams(Params):
    """What a fitted hora Model carries (horovod.spark.common.params.ModelParams)."""

    history = _param("history", "per-epoch train and validation metrics of the fit")
    model = _param("model", "the trained model")
    feature_columns = _param("feature_columns", "feature column names", TypeConverters.toListString)
    label_columns = _param("label_columns", "label column names", TypeConverters.toListString)
    output_cols = _param("output_cols", "prediction column names (default: <label>__output)",
                         TypeConverters.toListString)
    run_id = _param("run_id", "the run that trained the model")
    input_shapes = _param("input_shapes", "the shape each feature column is reshaped to")

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(history=None, model=None, feature_columns=None, label_columns=None, output_cols=None,
                         run_id=None, input_shapes=None)

    def getHistory(self) -> Any:  # Spark ML's naming
        """Per-epoch metrics: ``{"loss": [...], "val_loss": [...], <metric>: [...], ...}``."""
        return self.getOrDefault(self.history)

    def getOutputCols(self) -> list[str]:
        cols = self.getOrDefault(self.output_cols)
        return list(cols) if cols else [f"{label}__output" for label in self.getOrDefault(self.label_columns)]


def install_accessors(cls: type) -> type:
    """Add Horovod's ``setX``/``getX`` pair for every Param of ``cls`` (``setNumProc``...)."""
    for name in dir(cls):
        param = getattr(cls, name, None)
        if not isinstance(param, Param):
            continue
        camel = "".join(part.capitalize() for part in name.split("_"))
        if not hasattr(cls, f"set{camel}"):
            setattr(cls, f"set{camel}", _setter(name))
        if not hasattr(cls, f"get{camel}"):
            setattr(cls, f"get{camel}", _getter(name))
    return cls


def _setter(name: str) -> Any:
    def set_value(self: Params, value: Any) -> Params:
        return self._set(**{name: value})

    set_value.__name__ = f"set_{name}"
    return set_value


def _getter(name: str) -> Any:
    def get_value(self: Params) -> Any:
        return self.getOrDefault(getattr(self, name))

    get_value.__name__ = f"get_{name}"
    return get_value
