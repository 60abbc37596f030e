"""Who this worker is, as the launcher told it through the environment.

This is the one place hora reads a worker's identity (rank, size, local and cross coordinates, host,
the rendezvous address, the job secret and id): ``init()`` (through
:func:`hora.runtime.identity_for_init`, which also knows other launchers), the function runner
(:mod:`hora.runner.task`) and the world helpers ask :func:`from_environment`, and code that only needs
to know whether it runs inside a job asks :func:`is_worker`. A process not started by
``hora run`` (or :func:`hora.run`) gets one clear error naming every missing variable, instead of a
KeyError deep inside a connection attempt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hora import config
from hora.errors import ConfigError, HoraError
from hora.workers import launcher_env
from hora.workers.hosts import SlotInfo


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
    values: dict[str, Any] = {}
    missing: list[str] = []
    launched = None if config.is_set("rank", environ) else launcher_env.detect(environ)
    if launched is not None:
        # `hora run --mpi`: the job's store comes from hora, each rank's place from mpirun.
        values.update({item.name: getattr(launched, item.name) for item in fields(SlotInfo)})
    for item in fields(WorkerIdentity):
        if item.name in values:
            continue
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
    identity = WorkerIdentity(**values)
    _check_consistent(identity)
    return identity


def is_worker(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker of a job started by ``hora run`` / :func:`hora.run` (the
    launcher gives every worker its rank)."""
    return config.is_set("rank", environ)


def _check_consistent(identity: WorkerIdentity) -> None:
    for index, count in (("rank", "size"), ("local_rank", "local_size"), ("cross_rank", "cross_size")):
        i, n = getattr(identity, index), getattr(identity, count)
        if not 0 <= i < n:
            raise ConfigError(
                f"inconsistent worker identity: {config.knob(index).env}={i} but "
                f"{config.knob(count).env}={n}; start workers with `hora run`"
            )
