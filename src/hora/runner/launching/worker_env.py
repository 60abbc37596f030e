"""The environment each worker starts with.

A worker learns who it is (rank, size, local and cross coordinates), where the job's rendezvous
store is and the job secret only from its environment, under both the ``HORA_*`` names and the
``HOROVOD_*`` aliases a migrating script already reads. Everything is spelled through
:func:`hora.config.env_for`, so the names come from the one config table.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from hora import config
from hora.rendezvous import new_secret
from hora.workers.hosts import SlotInfo

IDENTITY_KNOBS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "hostname")


@dataclass(frozen=True)
class JobContext:
    """What every worker of one job shares: the rendezvous address, the secret and the job id."""

    rendezvous_addr: str
    rendezvous_port: int
    secret: str
    job_id: str

    @classmethod
    def fresh(cls, rendezvous_addr: str, rendezvous_port: int, secret: str | None = None) -> JobContext:
        """A new job: a fresh secret (unless given) and a fresh uuid job id."""
        return cls(rendezvous_addr, int(rendezvous_port), secret or new_secret(), uuid.uuid4().hex)

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        env.update(config.env_for("rendezvous_addr", self.rendezvous_addr))
        env.update(config.env_for("rendezvous_port", self.rendezvous_port))
        env.update(config.env_for("secret", self.secret))
        env.update(config.env_for("job_id", self.job_id))
        return env


def identity_environment(slot: SlotInfo) -> dict[str, str]:
    """``HORA_RANK``... and their ``HOROVOD_*`` aliases for one worker."""
    env: dict[str, str] = {}
    for name in IDENTITY_KNOBS:
        env.update(config.env_for(name, getattr(slot, name)))
    return env


def worker_environment(
    slot: SlotInfo,
    job: JobContext,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of one worker.

    ``base`` (default: the launcher's own environment) is inherited, ``extra`` (knobs from command
    line flags, the caller's ``env=``) is laid over it, and the identity and job variables win over
    both so a stale ``HORA_RANK`` in the launcher's environment cannot leak into a worker.
    ``PYTHONUNBUFFERED=1`` is added unless already set, so Python workers' output reaches the
    launcher line by line instead of in 8 KiB blocks.
    """
    env = dict(config.environ_copy() if base is None else base)
    if extra:
        env.update({str(key): str(value) for key, value in extra.items()})
    env.update(identity_environment(slot))
    env.update(job.environment())
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
