"""Who this worker is, as the launcher told it through the environment.

The transport and :mod:`hora.runner.task` call :func:`from_environment` once at start. A process not
started by ``hora run`` (or :func:`hora.run`) gets one clear error naming every missing variable,
instead of a KeyError deep inside a connection attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping

from hora import config
from hora.errors import ConfigError, HoraError
from hora.runner.hosts import SlotInfo


@dataclass(frozen=True)
class WorkerIdentity(SlotInfo):
    """A worker's place in the job (the launcher's :class:`SlotInfo` for it) and how to reach the
    job's rendezvous store: rank, size, local_rank, local_size, cross_rank, cross_size, hostname,
    rendezvous_addr, rendezvous_port, secret, job_id."""

    rendezvous_addr: str
    rendezvous_port: int
    secret: str
    job_id: str


def from_environment(environ: Mapping[str, str] | None = None) -> WorkerIdentity:
    """Read the identity set by the launcher (``HORA_*``, or the ``HOROVOD_*`` aliases).

    Raises :class:`HoraError` naming the missing variables when the process was not started by the
    launcher, and :class:`ConfigError` when the values contradict each other (rank >= size...).
    """
    values: dict[str, object] = {}
    missing: list[str] = []
    for item in fields(WorkerIdentity):
        if not config.is_set(item.name, environ):
            missing.append(config.knob(item.name).env)
            continue
        values[item.name] = config.get(item.name, environ)
    if missing:
        raise HoraError(
            f"this process has no hora worker identity: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; start workers with `hora run` "
            "(or hora.run)"
        )
    identity = WorkerIdentity(**values)  # type: ignore[arg-type]
    _check_consistent(identity)
    return identity


def _check_consistent(identity: WorkerIdentity) -> None:
    for index, count in (("rank", "size"), ("local_rank", "local_size"), ("cross_rank", "cross_size")):
        i, n = getattr(identity, index), getattr(identity, count)
        if not 0 <= i < n:
            raise ConfigError(
                f"inconsistent worker identity: {config.knob(index).env}={i} but "
                f"{config.knob(count).env}={n}; start workers with `hora run`"
            )
