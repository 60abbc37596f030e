"""hora.spark.lightning: horovod.spark.lightning's ``TorchEstimator`` and ``TorchModel``: a PyTorch
Lightning module trained on a Spark DataFrame with :class:`hora.lightning.HoraStrategy` in each task
(see docs/spark.md for the estimator workflow). Needs ``lightning`` (2.2 or newer) besides
``hora[spark]``."""

from hora.spark.lightning.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
