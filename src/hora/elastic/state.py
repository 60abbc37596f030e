"""The state elastic training keeps across a re-formed world: what to save, restore and share.

A training loop wrapped by :func:`hora.elastic.run` commits its state every so often. When a peer
fails, every surviving rank rolls back to its last commit (``restore``), the world is re-formed, and
rank 0 of the new world hands its state to everyone (``sync``), so workers that just joined start
from the same point as the survivors. When hosts are announced as added or removed, ``commit`` raises
:class:`~hora.errors.HostsUpdatedInterrupt` on every rank at the same commit, and the current
(just committed) state is kept.

:class:`State` is the framework-neutral base; framework states (``hora.torch.elastic.TorchState``...)
implement ``save``, ``restore`` and ``sync`` for their models and optimizers. :class:`ObjectState`
keeps any picklable attributes.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from hora import basics
from hora.collectives import allreduce, broadcast_object
from hora.elastic.notification import read_hosts_update
from hora.errors import HostsUpdatedInterrupt
from hora.transport.base import ReduceOp

logger = logging.getLogger(__name__)

BroadcastObject = Callable[..., Any]


class State:
    """Base of every elastic state: commits, host-update checks and reset callbacks.

    ``bcast_object(obj, root_rank=0)`` and ``get_rank()`` default to hora's own
    :func:`hora.broadcast_object` and :func:`hora.rank`; a binding may pass its own.
    """

    def __init__(self, bcast_object: BroadcastObject | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object: BroadcastObject = bcast_object if bcast_object is not None else broadcast_object
        self._get_rank: Callable[[], int] = get_rank if get_rank is not None else basics.rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        # The newest host-update announcement this world already reflects (None: take whatever the
        # store holds at the next check as reflected: a world formed after an announcement has it).
        self._hosts_update_seen: int | None = None

    # ---- what subclasses implement -------------------------------------------------------------

    def save(self) -> None:
        """Keep a copy of the current state, for ``restore`` after a failure."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put back the state of the last ``save`` (the last commit)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's (rank 0 of the world as it is now)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Hook for subclasses that must rebuild something when the world changed (the default does
        nothing); runs in :meth:`on_reset` before the reset callbacks."""

    # ---- the shared behaviour -------------------------------------------------------------------

    def commit(self) -> None:
        """Save the state, then check for host updates.

        Committing is the one place where a host change interrupts training, so every rank is
        interrupted at the same step with a state just saved: nothing since the commit is lost.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if hosts were announced as changed.

        Every rank reads the announcement key once, then all ranks agree through one small allreduce
        (max) on the newest announcement anyone saw and the newest one the world already reflects,
        so all of them raise at this same call, or none does: a rank that read the key a moment
        before the driver wrote it cannot keep training while the others re-form. ``skip_sync`` is
        the newest announcement's (if ranks read it with different flags, the sync is kept).

        The elastic driver writes the announcement before it opens the round with the new hosts.
        """
        runtime = basics._ctx.runtime
        if runtime is None:
            raise ValueError("hora has not been initialized; call hora.init() first")
        update = read_hosts_update(runtime.store)
        newest = -1 if update is None else update.id
        reflected = self._hosts_update_seen
        if reflected is None:  # first check in this world: what did the world form with?
            reflected = runtime.round.announcement if runtime.round.announcement is not None else newest
        # One number orders announcements by id, then "needs a sync" above "may skip it": the max is
        # the newest announcement any rank read, with the skip flag of that announcement.
        needs_sync = 0 if update is not None and update.skip_sync else 1
        agreed = allreduce(np.array([2 * newest + needs_sync, reflected], dtype=np.int64), op=ReduceOp.MAX)
        newest, needs_sync = divmod(int(agreed[0]), 2)
        reflected = int(agreed[1])
        self._hosts_update_seen = max(newest, reflected)
        if newest > reflected:
            logger.info("rank %d: hosts updated (announcement %d); re-forming the world",
                        basics.rank(), newest)
            raise HostsUpdatedInterrupt(skip_sync=not needs_sync)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions to call after every reset (e.g. to scale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called once the world is re-formed: note the host announcements the new world already
        reflects, run :meth:`reset`, then the registered callbacks in order."""
        runtime = basics._ctx.runtime
        if runtime is not None and runtime.round.announcement is not None:
            self._hosts_update_seen = runtime.round.announcement  # the driver says what it reflects
        elif runtime is not None:
            update = read_hosts_update(runtime.store)
            self._hosts_update_seen = None if update is None else update.id
        else:
            self._hosts_update_seen = None
        self.reset()
        for callback in self._reset_callbacks:
            callback()


class ObjectState(State):
    """Elastic state made of picklable attributes, given as keyword arguments.

    ``ObjectState(epoch=0, batch=0)`` makes ``state.epoch`` and ``state.batch`` attributes. ``save``
    keeps a deep copy of each (so later in-place changes do not alter the commit), ``restore`` puts
    a deep copy back, and ``sync`` broadcasts the committed values from rank 0 with
    ``bcast_object``.
    """

    if TYPE_CHECKING:  # the keyword arguments' attributes, any name: what type checkers may assume
        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...

    def __init__(self, bcast_object: BroadcastObject | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(bcast_object, get_rank)
        self._saved_state: dict[str, Any] = copy.deepcopy(kwargs)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        """Every rank takes rank 0's committed values (rank 0 of the world as it is now)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()
