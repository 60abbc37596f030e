"""Elastic training, worker side: states that survive a re-formed world, and the loop that re-forms it.

``hora.elastic.run(func)`` wraps a training function taking a :class:`State`; when a collective fails
(:class:`~hora.errors.HorovodInternalError`) or hosts are announced as changed
(:class:`~hora.errors.HostsUpdatedInterrupt`), it re-forms the world in the same process (``shutdown()``
then ``init()``, which joins the next rendezvous round), syncs the state and calls ``func`` again.

Every piece of elastic training, from here: the launcher's side, which discovers hosts, opens each
new round with its plan, starts workers on new hosts and announces host changes, is
:mod:`hora.runner.elastic` (``hora run --min-np ...``); each framework's state classes are in its
binding (``hora.torch.elastic``, ``hora.tensorflow.elastic``, ``hora.keras.elastic``, and the Keras
variables in :mod:`hora.elastic_variables`); Ray's and Spark's elastic executors are
:mod:`hora.ray.elastic` and :mod:`hora.spark.elastic`.
"""

from hora.elastic.loop import ResetLimitError, run, run_fn
from hora.elastic.state import ObjectState, State

__all__ = ["State", "ObjectState", "run", "run_fn", "ResetLimitError"]
