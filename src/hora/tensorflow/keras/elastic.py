"""``hora.tensorflow.keras.elastic``: Horovod's spelling of :mod:`hora.keras.elastic` (the same objects)."""

from __future__ import annotations

from hora.keras.elastic import (
    CommitStateCallback as CommitStateCallback,
    KerasState as KerasState,
    UpdateBatchStateCallback as UpdateBatchStateCallback,
    UpdateEpochStateCallback as UpdateEpochStateCallback,
    __all__ as __all__,
    run as run,
)
