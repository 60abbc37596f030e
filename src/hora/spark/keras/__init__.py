"""hora.spark.keras: horovod.spark.keras's ``KerasEstimator`` and ``KerasModel`` (see docs/spark.md)."""

from hora.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
