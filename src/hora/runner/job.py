"""One local job: its rendezvous store, its workers' environments, and their supervision.

Both ``hora run`` and :func:`hora.run` go through :class:`LocalJob`: it validates the layout (every
used host must be this machine until SSH launch exists), starts the job's rendezvous server with a
fresh secret, builds each rank's environment and hands the workers to the supervisor. The store
stays readable until the job is closed, so :func:`hora.run` can collect results after the workers
exit.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence, TextIO

from hora import config
from hora.rendezvous import KeyValueStore, RendezvousServer, new_secret
from hora.runner.hosts import Host, SlotInfo, assign_slots, hosts_used
from hora.runner.launch import JobOutcome, WorkerSpec, run_workers
from hora.runner.locality import require_local_hosts
from hora.runner.output import OutputRouter
from hora.runner.worker_env import JobContext, worker_environment

logger = logging.getLogger(__name__)

# Local-only jobs keep the store off the network entirely.
LOCAL_BIND_ADDRESS = "127.0.0.1"


class LocalJob:
    """A job whose every rank runs on this machine.

    Use as a context manager: entering starts the rendezvous server, leaving stops it.
    ``command`` is either one argv for every rank or a function of the rank's :class:`SlotInfo`.
    """

    def __init__(
        self,
        hosts: Sequence[Host],
        np: int,
        command: Sequence[str] | Callable[[SlotInfo], Sequence[str]],
        extra_env: Mapping[str, str] | None = None,
        base_env: Mapping[str, str] | None = None,
        output_dir: str | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        kill_grace: float | None = None,
    ) -> None:
        require_local_hosts(hosts_used(list(hosts), np))
        self.slots = assign_slots(list(hosts), np)
        self.np = np
        self._command = command
        self._extra_env = dict(extra_env or {})
        self._base_env = base_env
        self._router = OutputRouter(stdout=stdout, stderr=stderr, output_dir=output_dir, size=np)
        self._kill_grace = config.get("kill_grace") if kill_grace is None else kill_grace
        self._server: RendezvousServer | None = None
        self.context: JobContext | None = None

    def __enter__(self) -> "LocalJob":
        secret = new_secret()  # fresh per job: a worker of another job cannot join this one
        self._server = RendezvousServer(secret, host=LOCAL_BIND_ADDRESS, port=0).start()
        host, port = self._server.address
        self.context = JobContext.fresh(host, port, secret=secret)
        logger.info("job %s: rendezvous store at %s:%d", self.context.job_id, host, port)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def store(self) -> KeyValueStore:
        """The job's key-value table, readable and writable directly by the launcher."""
        if self._server is None:
            raise RuntimeError("the job's rendezvous server is not running (use LocalJob as a context manager)")
        return self._server.store

    def _argv(self, slot: SlotInfo) -> list[str]:
        command = self._command(slot) if callable(self._command) else self._command
        return [str(part) for part in command]

    def specs(self) -> list[WorkerSpec]:
        """Each rank's command line and full environment."""
        if self.context is None:
            raise RuntimeError("enter the LocalJob before building worker specs")
        return [
            WorkerSpec(
                rank=slot.rank,
                host=slot.hostname,
                argv=self._argv(slot),
                env=worker_environment(slot, self.context, base=self._base_env, extra=self._extra_env),
            )
            for slot in self.slots
        ]

    def run(self, handle_signals: bool = False) -> JobOutcome:
        """Start every rank and supervise until success, the first failure, or a launcher signal."""
        return run_workers(self.specs(), self._router, kill_grace=self._kill_grace,
                           handle_signals=handle_signals)
