"""The elastic training loop: run, and on a failure or a host change re-form the world and go on.

``run(func)`` returns ``wrapper(state, *args, **kwargs)``, which calls ``func(state, ...)`` until it
returns:

- first (and after every reset unless the interrupt said to skip it) ``state.sync()``: every rank
  takes rank 0's state, so workers new to the world start where the survivors are;
- on :class:`~hora.errors.HorovodInternalError` (a peer failed mid-collective): ``state.restore()``
  (back to the last commit, since what happened after it may be half-applied), then reset;
- on :class:`~hora.errors.HostsUpdatedInterrupt` (raised by ``state.commit()`` on every rank at the
  same commit): keep the state as committed, then reset;
- reset: ``hora.shutdown()`` then ``hora.init()``, which joins the job's next rendezvous round in
  this same process (no worker is restarted), then ``state.on_reset()``.

The sync runs inside the same guard as ``func``, so a peer lost during the sync causes one more
reset instead of ending the job. ``HORA_ELASTIC_RESET_LIMIT`` bounds the resets of one call.

In a job started by the elastic driver (``HORA_ELASTIC=1``), ``init()`` waits for the round the
driver opens; a worker that round leaves out exits with status 0. Elsewhere, the first worker to
re-initialise opens the next round with the previous round's plan.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from hora import basics, config
from hora.errors import HoraError, HorovodInternalError, HostsUpdatedInterrupt

logger = logging.getLogger(__name__)

R = TypeVar("R")


class ResetLimitError(HoraError):
    """Elastic training needed more resets than ``HORA_ELASTIC_RESET_LIMIT`` allows."""


def _reset_world() -> None:
    """Leave the current world and join the next rendezvous round, in this process."""
    basics.shutdown()
    basics.init()


def run_fn(func: Callable[..., R], reset: Callable[[], None]) -> Callable[..., R]:
    """Wrap ``func(state, *args, **kwargs)`` in the elastic loop, re-forming the world with ``reset``.

    Bindings pass their own ``reset`` when re-forming needs more than ``shutdown()``/``init()``.
    """

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> R:
        limit = config.get("elastic_reset_limit")
        resets = 0
        skip_sync = False
        while True:
            cause: HorovodInternalError | HostsUpdatedInterrupt
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                logger.warning("rank %s: a collective failed (%s); restoring the last commit and "
                               "re-forming the world", _rank_or_unknown(), exc)
                state.restore()
                skip_sync, cause = False, exc
            except HostsUpdatedInterrupt as exc:
                skip_sync, cause = exc.skip_sync, exc
            if limit is not None and resets >= limit:
                raise ResetLimitError(
                    f"elastic training stops: it already reset {resets} time(s), the limit set by "
                    f"{config.knob('elastic_reset_limit').env}={limit}, and needed another after: "
                    f"{type(cause).__name__}: {cause}") from cause
            resets += 1
            reset()
            state.on_reset()

    return wrapper


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Horovod's ``hvd.elastic.run``: ``func(state, ...)`` survives failed peers and host changes by
    re-forming the world in this process (see the module docstring)."""
    return run_fn(func, _reset_world)


def _rank_or_unknown() -> str:
    coordinates = basics._ctx.coordinates
    return "?" if coordinates is None else str(coordinates.rank)
