"""``hora.tensorflow.keras.callbacks``: Horovod's spelling of :mod:`hora.keras.callbacks` (the same classes)."""

from __future__ import annotations

from hora.keras.callbacks import (
    BestModelCheckpoint as BestModelCheckpoint,
    BroadcastGlobalVariablesCallback as BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback as LearningRateScheduleCallback,
    LearningRateWarmupCallback as LearningRateWarmupCallback,
    MetricAverageCallback as MetricAverageCallback,
    broadcast_model_state as broadcast_model_state,
)
