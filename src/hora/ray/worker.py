"""One hora worker inside a Ray actor.

The actor is plain Python: the driver (:class:`hora.ray.RayExecutor`) asks it where it runs, gives
it its rank's environment (the same variables ``hora run`` gives a worker process, built by
:func:`hora.runner.launching.worker_env.worker_environment`), then calls functions on it. ``hora.init()``
inside those functions reads that environment and joins the job like any other worker.

A function that raises leaves hora shut down on this worker before the exception travels back, so
peers waiting on it in a collective fail at once instead of waiting for a rank that has given up,
and the next ``hora.init()`` forms the world again.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from hora import config
from hora.errors import HoraError
from hora.ray import ray_logger
from hora.workers.remote_bootstrap import resolve_listen_address

logger = logging.getLogger(__name__)


class Call:
    """``fn(*args, **kwargs)`` as a function of the executable, which ``run`` does not use."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> None:
        self.fn = fn
        self.args = tuple(args or ())
        self.kwargs = dict(kwargs or {})

    def __call__(self, executable: Any) -> Any:
        return self.fn(*self.args, **self.kwargs)


def _failed(exc: BaseException) -> None:
    """A function raised: keep its traceback on the exception (it travels back pickled, with its
    attributes), then leave hora shut down here."""
    try:
        exc.hora_remote_traceback = traceback.format_exc()  # type: ignore[attr-defined]  # hora's own attribute on any exception
    except AttributeError:
        pass  # the driver falls back to Ray's formatted text
    stop_hora()


def _exited(exc: SystemExit) -> HoraError:
    """``sys.exit()`` in a function would end the actor itself (Ray treats it as the worker leaving),
    and the driver would see a lost worker; it becomes an error that says what the function did."""
    error = HoraError(f"the function called sys.exit({exc.code!r}) (a worker is a Ray actor: raise an "
                      "exception to fail, or return a value)")
    _failed(error)
    return error


def _last_rank() -> int | None:
    """This worker's rank in the last world it joined (elastic jobs re-rank their workers)."""
    basics = sys.modules.get("hora.basics")
    last = getattr(getattr(basics, "_ctx", None), "last_rank", None)
    return None if last is None else int(last)


def _mark_rank(exc: BaseException) -> None:
    """Attach the rank the worker had when it raised (the driver names it)."""
    rank = _last_rank()
    if rank is not None:
        try:
            exc.hora_rank = rank  # type: ignore[attr-defined]  # hora's own attribute on any exception
        except AttributeError:
            pass


def stop_hora() -> None:
    """Shut hora down in this process if a function initialised it (never raises)."""
    basics = sys.modules.get("hora.basics")
    if basics is not None and basics.is_initialized():
        basics.shutdown()


class RayWorker:
    """The actor class (``ray.remote`` is applied by the executor, with the job's resources)."""

    def __init__(self, sys_path: Sequence[str]) -> None:
        # The driver's import path, so functions and classes pickled by reference (defined in the
        # driver's modules) import here too; entries missing on this node change nothing.
        for entry in sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        self.rank: int | None = None
        self.executable: Any = None

    def where(self) -> dict[str, Any]:
        """This actor's Ray node, address, host name, process and GPUs."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
        }

    def configure(self, rank: int, env: Mapping[str, str], nics: Sequence[str] | None) -> None:
        """Take this rank's environment; with ``nics``, listen for peers on the first that exists here."""
        env = dict(env)
        if nics:
            try:
                address = resolve_listen_address(list(nics))
            except LookupError as exc:
                raise RuntimeError(f"nics={sorted(nics)} on {socket.gethostname()}: {exc}") from None
            env.update(config.env_for("iface", address, with_alias=False))
        os.environ.update(env)
        self.rank = rank

    def start_executable(self, executable_cls: type | None, args: Sequence[Any] | None,
                         kwargs: Mapping[str, Any] | None) -> None:
        """Build the object ``execute`` passes to functions (None without a class)."""
        if executable_cls is None:
            self.executable = None
            return
        try:
            self.executable = executable_cls(*(args or ()), **(kwargs or {}))
        except SystemExit as exc:
            raise _exited(exc) from None
        except BaseException as exc:
            _failed(exc)
            raise

    def execute(self, fn: Callable[[Any], Any], call_id: str | None = None) -> Any:
        """``fn(executable)``; values it logs reach the driver's callbacks of call ``call_id``."""
        with ray_logger.active(call_id, self.rank if self.rank is not None else -1):
            try:
                return fn(self.executable)
            except SystemExit as exc:
                raise _exited(exc) from None
            except BaseException as exc:
                _failed(exc)
                raise

    def run_elastic(self, call: Callable[[Any], Any], call_id: str | None = None) -> dict[str, Any]:
        """Run an elastic job's function: ``{"rank": final rank, "value": result}``, or
        ``{"left": True}`` when the worker left a world that had no place for it (``hora.init()``
        ends such a worker with ``SystemExit(0)``, as it ends a process)."""
        with ray_logger.active(call_id, self.rank if self.rank is not None else -1):
            try:
                value = call(self.executable)
            except SystemExit as exc:
                if exc.code in (0, None):
                    stop_hora()
                    return {"left": True}
                raise _exited(exc) from None
            except BaseException as exc:
                _mark_rank(exc)
                _failed(exc)
                raise
        return {"rank": _last_rank(), "value": value}

    def stop_hora(self) -> None:
        """Shut hora down here, so the next ``hora.init()`` joins a newly formed world."""
        stop_hora()
