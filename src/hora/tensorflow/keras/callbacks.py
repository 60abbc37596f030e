"""``hora.tensorflow.keras.callbacks``: Horovod's spelling of :mod:`hora.keras.callbacks` (the same classes)."""

from __future__ import annotations

from hora.keras.callbacks import (  # noqa: F401
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    broadcast_model_state,
)
