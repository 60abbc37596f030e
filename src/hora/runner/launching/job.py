"""One job: its rendezvous store, its workers' environments, and their supervision.

Both ``hora run`` and :func:`hora.run` go through :class:`Job`. It lays ranks out on the hosts,
starts ranks on this machine as child processes and ranks on other hosts over SSH (see
:mod:`hora.runner.ssh.remote`), starts the job's rendezvous server with a fresh secret, builds each
rank's environment and hands the workers to the supervisor. The store stays readable until the job
is closed, so :func:`hora.run` can collect results after the workers exit.

A job on this machine alone keeps its store on loopback. With a remote host, every remote host is
first checked with ``ssh HOST true`` (all at once; nothing starts if one fails), and the store
listens on an address they can reach (:func:`hora.workers.network.launcher_address`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from hora import config
from hora.errors import LaunchError
from hora.rendezvous import KeyValueStore, RendezvousServer, new_secret
from hora.runner.launching.launch import JobOutcome, WorkerSpec, run_workers
from hora.runner.launching.locality import is_local_host
from hora.runner.launching.output import OutputRouter
from hora.runner.launching.worker_env import JobContext, worker_environment
from hora.runner.ssh.options import SshOptions, check_reachable
from hora.runner.ssh.remote import RemoteTarget, forwarded_environment
from hora.workers.hosts import Host, SlotInfo, assign_slots, hosts_used
from hora.workers.network import launcher_address
from hora.workers.remote_bootstrap import resolve_listen_address

logger = logging.getLogger(__name__)

# Jobs on this machine alone keep the store off the network entirely.
LOCAL_BIND_ADDRESS = "127.0.0.1"


class Job:
    """A job whose ranks run on this machine and, over SSH, on other hosts.

    Use as a context manager: entering checks the remote hosts and starts the rendezvous server,
    leaving stops it. ``command`` is either one argv for every rank or a function of the rank's
    :class:`SlotInfo`. ``ssh`` configures connections to remote hosts (default: the ``ssh_*``
    knobs); ``network_interfaces`` (interface names or addresses, first match per host) chooses the
    address workers listen on; ``cwd`` is where remote workers start (default: this directory);
    ``timestamps`` starts each forwarded output line with the time it arrived.
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
        ssh: SshOptions | None = None,
        network_interfaces: Sequence[str] | None = None,
        cwd: str | None = None,
        timestamps: bool = False,
        all_hosts: bool = False,
    ) -> None:
        # An elastic job may use every host it was given (its driver decides the layout later), so
        # all of them count for where the store listens; a fixed job only the ones its ranks fill.
        used = list(hosts) if all_hosts else hosts_used(list(hosts), np)
        self._all_hosts = all_hosts
        self.slots = assign_slots(list(hosts), np)
        self.np = np
        self.remote_hosts = [host.name for host in used if not is_local_host(host.name)]
        self._command = command
        self._extra_env = dict(extra_env or {})
        self._base_env = base_env
        self._router = OutputRouter(stdout=stdout, stderr=stderr, output_dir=output_dir, size=np,
                                    timestamps=timestamps)
        self._kill_grace = config.get("kill_grace") if kill_grace is None else kill_grace
        self._interfaces = tuple(network_interfaces) if network_interfaces else None
        self._ssh = (ssh or SshOptions.from_config()) if self.remote_hosts else ssh
        self._cwd = cwd or os.getcwd()
        self._local_iface: str | None = None
        if self._interfaces and len(self.remote_hosts) < len(used):
            try:  # ranks on this machine listen on its entry of --network-interfaces
                self._local_iface = resolve_listen_address(self._interfaces)
            except LookupError as exc:
                raise LaunchError(f"--network-interfaces on this machine: {exc}") from None
        self._server: RendezvousServer | None = None
        self.context: JobContext | None = None
        # Whether the store listens on loopback only (every host was this machine at the start).
        self.local_only = True

    def __enter__(self) -> Job:
        bind = LOCAL_BIND_ADDRESS
        if self.remote_hosts:
            assert self._ssh is not None
            check_reachable(self.remote_hosts, self._ssh)
            bind = launcher_address(self.remote_hosts, self._interfaces)
        elif self._all_hosts and self._interfaces:
            # An elastic job on this machine only, for now: with --network-interfaces, listen where
            # hosts found later can reach the store.
            try:
                bind = resolve_listen_address(self._interfaces)
            except LookupError as exc:
                raise LaunchError(f"--network-interfaces on this machine: {exc}") from None
        secret = new_secret()  # fresh per job: a worker of another job cannot join this one
        self.local_only = bind == LOCAL_BIND_ADDRESS
        self._server = RendezvousServer(secret, host=bind, port=0).start()
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
            raise RuntimeError("the job's rendezvous server is not running (use Job as a context manager)")
        return self._server.store

    def _argv(self, slot: SlotInfo) -> list[str]:
        command = self._command(slot) if callable(self._command) else self._command
        return [str(part) for part in command]

    def spec_for(self, slot: SlotInfo, extra_env: Mapping[str, str] | None = None) -> WorkerSpec:
        """The worker to start for ``slot``: here, or over SSH when its host is another machine
        (the elastic driver starts workers for hosts found after the job began this way)."""
        if self.context is None:
            raise RuntimeError("enter the Job before building worker specs")
        extra = {**self._extra_env, **(extra_env or {})}
        env = worker_environment(slot, self.context, base=self._base_env, extra=extra)
        if slot.hostname not in self.remote_hosts and is_local_host(slot.hostname):
            if self._local_iface is not None:
                env.update(config.env_for("iface", self._local_iface, with_alias=False))
            return WorkerSpec(slot.rank, slot.hostname, self._argv(slot), env)
        if self._ssh is None:
            self._ssh = SshOptions.from_config()
        target = RemoteTarget(ssh=self._ssh, cwd=self._cwd, job_id=self.context.job_id,
                              interfaces=self._interfaces, kill_grace=float(self._kill_grace))
        return WorkerSpec(slot.rank, slot.hostname, self._argv(slot), forwarded_environment(env),
                          remote=target)

    def specs(self) -> list[WorkerSpec]:
        """Each rank's command line, full environment and (for remote ranks) how to reach its host."""
        if self.context is None:
            raise RuntimeError("enter the Job before building worker specs")
        return [self.spec_for(slot) for slot in self.slots]

    @property
    def router(self) -> OutputRouter:
        """Where the workers' output goes (shared with the elastic driver)."""
        return self._router

    @property
    def kill_grace(self) -> float:
        return float(self._kill_grace)

    def run(self, handle_signals: bool = False) -> JobOutcome:
        """Start every rank and supervise until success, the first failure, or a launcher signal."""
        return run_workers(self.specs(), self._router, kill_grace=self._kill_grace,
                           handle_signals=handle_signals)
