"""``import hora.tensorflow.keras as hvd``: Horovod's spelling of :mod:`hora.keras` (the same objects)."""

from __future__ import annotations

from hora.keras import *  # noqa: F403 - re-exported: hora.keras's API (its __all__), the same objects
from hora.keras import __all__ as __all__
from hora.tensorflow.keras import callbacks as callbacks, elastic as elastic  # hvd.callbacks, as in Horovod
