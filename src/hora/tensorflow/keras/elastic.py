"""``hora.tensorflow.keras.elastic``: Horovod's spelling of :mod:`hora.keras.elastic` (the same objects)."""

from __future__ import annotations

from hora.keras.elastic import (  # noqa: F401
    CommitStateCallback,
    KerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)
from hora.keras.elastic import __all__  # noqa: F401
