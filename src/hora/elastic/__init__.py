"""Elastic training, worker side: states that survive a re-formed world, and the loop that re-forms it.

``hora.elastic.run(func)`` wraps a training function taking a :class:`State`; when a collective fails
(:class:`~hora.errors.HorovodInternalError`) or hosts are announced as changed
(:class:`~hora.errors.HostsUpdatedInterrupt`), it re-forms the world in the same process (``shutdown()``
then ``init()``, which joins the next rendezvous round), syncs the state and calls ``func`` again.

What is not built yet: the launcher's elastic driver (host discovery, starting workers on new hosts,
opening rounds with a new plan, blacklisting). Without it, a re-formed world has the same size as the
previous one, and host changes are announced only by whoever writes the store key
(:mod:`hora.elastic.notification`).
"""

from hora.elastic.loop import ResetLimitError, run, run_fn
from hora.elastic.state import ObjectState, State

__all__ = ["State", "ObjectState", "run", "run_fn", "ResetLimitError"]
