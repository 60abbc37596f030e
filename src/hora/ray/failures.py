"""How a Ray worker's failure reads on the driver: one line for logs, the worker's own exception for callers."""

from __future__ import annotations

import logging
import re

import ray.exceptions

from hora.errors import HoraError

logger = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the process line of its formatted tracebacks


def strip_colours(text: str) -> str:
    return _ANSI.sub("", text)


def first_line(value: object) -> str:
    text = str(value).strip()
    return text.splitlines()[0] if text else type(value).__name__


def lost_reason(exc: BaseException) -> str:
    """Ray's explanation of a lost actor, on one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def remote_exception(task_error: ray.exceptions.RayTaskError, rank: int, where: str,
                     stopped: str | None) -> BaseException:
    """The worker's own exception, with its rank and remote traceback attached (as hora.run does)."""
    exc = task_error.cause
    remote = getattr(exc, "hora_remote_traceback", None) or strip_colours(str(task_error))
    remote = remote.rstrip()
    if not isinstance(exc, BaseException) or isinstance(exc, ray.exceptions.RayError):
        exc = HoraError(f"hora.ray: rank {rank} ({where}) raised an exception that cannot be sent back as an "
                        f"object; remote traceback:\n{remote}")
    elif hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"raised on rank {rank} ({where}); remote traceback:\n{remote}")
    if stopped and hasattr(exc, "add_note"):
        exc.add_note(stopped)
    try:
        exc.hora_rank = rank
        exc.hora_remote_traceback = remote
    except AttributeError:
        logger.debug("cannot attach the rank to %r", exc)
    return exc
