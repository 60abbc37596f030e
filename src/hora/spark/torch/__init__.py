"""hora.spark.torch: horovod.spark.torch's ``TorchEstimator`` and ``TorchModel`` (see docs/spark.md)."""

from hora.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
