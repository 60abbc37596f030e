"""``import hora.tensorflow.keras as hvd``: Horovod's spelling of :mod:`hora.keras` (the same objects)."""

from __future__ import annotations

from hora.keras import *  # noqa: F401,F403
from hora.keras import __all__  # noqa: F401
from hora.tensorflow.keras import callbacks, elastic  # noqa: F401 - hvd.callbacks, hvd.elastic, as in Horovod
