"""The worker side of :func:`hora.run`: ``python -m hora.runner.task``.

The launcher put ``cloudpickle.dumps((func, args, kwargs))`` into the job's rendezvous store. Each
worker fetches it over an authenticated connection (so unpickling it runs nothing a stranger sent),
calls it, and stores its outcome under ``result/<rank>`` (the rank of the last world it joined, which
in an elastic job may differ from the one it started with):

- ``("ok", value)`` when the call returned;
- ``("error", exception_pickle_or_None, repr_text, traceback_text)`` when it raised. The exception is
  pickled separately, and only if it also unpickles here, so the launcher can always report at
  least its repr and traceback even when the exception object itself cannot travel.

A worker that stored an error exits 1, so the launcher stops the other workers at once.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from typing import Any

import cloudpickle

from hora import config
from hora.errors import HoraError
from hora.rendezvous import RendezvousClient
from hora.workers.identity import from_environment

logger = logging.getLogger(__name__)

FUNC_KEY = "run/func"
SYS_PATH_KEY = "run/sys_path"
RESULT_PREFIX = "result/"


def result_key(rank: int) -> str:
    return f"{RESULT_PREFIX}{rank}"


def encode_success(value: Any) -> bytes:
    return cloudpickle.dumps(("ok", value))


def encode_error(exc: BaseException, traceback_text: str) -> bytes:
    """Pickle a raised exception, falling back to its repr when it cannot make the round trip."""
    blob: bytes | None
    try:
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)  # an exception that pickles but cannot be rebuilt is no use to the launcher
    except Exception:  # any failure means "send the repr instead"
        blob = None
    return cloudpickle.dumps(("error", blob, repr(exc), traceback_text))


def _extend_sys_path(entries: list[str]) -> None:
    """Make the launcher's import path visible, so functions pickled by reference can be imported."""
    for entry in entries:
        if entry not in sys.path:
            sys.path.append(entry)


def _call(client: RendezvousClient, rank: int, timeout: float) -> tuple[bool, bytes | None]:
    """Fetch and run the function; (succeeded, encoded outcome). No outcome when an elastic worker
    left a world that had no place for it: it has no result, and a rank of the final world may
    hold the rank it last had."""
    try:
        _extend_sys_path(json.loads(client.get(SYS_PATH_KEY, timeout=timeout)))
        func, args, kwargs = cloudpickle.loads(client.get(FUNC_KEY, timeout=timeout))
        value = func(*args, **kwargs)
    except SystemExit as exc:
        if exc.code in (0, None) and config.get("elastic"):
            return True, None
        return False, encode_error(exc, traceback.format_exc())
    except BaseException as exc:  # SystemExit and friends are reported too
        return False, encode_error(exc, traceback.format_exc())
    try:
        return True, encode_success(value)
    except Exception as exc:
        error = HoraError(
            f"rank {rank}: the function returned {type(value).__name__} value that cannot be "
            f"pickled ({exc}); return something picklable"
        )
        return False, encode_error(error, traceback.format_exc())


def _final_rank(launch_rank: int) -> int:
    """The rank this worker's result belongs to: its rank in the last world it joined (elastic jobs
    re-rank survivors), or the launcher's rank when the function never joined one."""
    basics = sys.modules.get("hora.basics")
    last = getattr(getattr(basics, "_ctx", None), "last_rank", None)
    return launch_rank if last is None else int(last)


def main() -> int:
    """Run the job's function once on this rank; 0 when it returned, 1 when it raised."""
    identity = from_environment()
    timeout = config.get("start_timeout")
    with RendezvousClient(identity.rendezvous_addr, identity.rendezvous_port, identity.secret,
                          connect_timeout=timeout) as client:
        succeeded, outcome = _call(client, identity.rank, timeout)
        if outcome is not None:
            client.set(result_key(_final_rank(identity.rank)), outcome)
    return 0 if succeeded else 1


if __name__ == "__main__":
    sys.exit(main())
