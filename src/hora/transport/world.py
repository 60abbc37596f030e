"""Connect the communicator of all workers of a job started by ``hora run`` / :func:`hora.run`.

The engine's ``init()`` calls this; benchmarks and the conformance suite use it directly.
"""

from __future__ import annotations

import itertools

from hora import config
from hora.errors import HoraError
from hora.rendezvous.client import RendezvousClient
from hora.transport import create_communicator
from hora.transport.base import Communicator

_generation = itertools.count()

_REQUIRED = ("rank", "size", "rendezvous_addr", "rendezvous_port", "secret")


def connect_world(transport: str = "tcp", store: RendezvousClient | None = None, **options: object) -> Communicator:
    """The communicator of every rank in the job, in global rank order.

    Every rank must call it the same number of times: each call forms a new, separate group (so
    ``init`` after ``shutdown`` works).
    """
    missing = [config.knob(name).env for name in _REQUIRED if config.get(name) is None]
    if missing:
        raise HoraError(
            f"this process was not started by hora: {', '.join(missing)} not set; "
            "start workers with `hora run -np N ...` or hora.run(...)"
        )
    rank, size = config.get("rank"), config.get("size")
    if not 0 <= rank < size:
        raise HoraError(f"HORA_RANK={rank} is outside a job of HORA_SIZE={size}")
    secret = config.get("secret")
    if store is None:
        store = RendezvousClient(
            config.get("rendezvous_addr"),
            config.get("rendezvous_port"),
            secret,
            connect_timeout=config.get("start_timeout"),
        )
    scope = f"{config.get('job_id') or 'job'}/world/{next(_generation)}"
    return create_communicator(transport, rank, list(range(size)), store, scope, secret, **options)
