"""Starting an elastic job: from ``hora run``'s flags or :func:`hora.run`'s parameters to a running driver.

Both front ends describe the job as an :class:`ElasticRequest`, so the defaults and checks are the same
whichever a user starts from: ``--min-np`` defaults to ``-np`` and ``-np`` to ``--min-np``, ``--max-np``
to no limit, ``--elastic-timeout`` to 600 s (Horovod's), and hosts come from a discovery script (or
function), else ``-H``/``--hostfile``, else ``localhost:np``. :func:`run_elastic` opens the job's
rendezvous store and hands the job to :class:`~hora.runner.elastic.driver.ElasticDriver`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from hora import config
from hora.errors import ConfigError
from hora.rendezvous import KeyValueStore
from hora.runner.elastic.discovery import (
    DiscoveryError,
    DiscoveryFunction,
    FixedHosts,
    FunctionDiscovery,
    HostDiscovery,
    ScriptDiscovery,
)
from hora.runner.elastic.driver import ElasticDriver, ElasticOutcome, ElasticSettings
from hora.runner.launching.job import Job
from hora.runner.ssh.options import SshOptions
from hora.workers.hosts import Host, SlotInfo, default_hosts, parse_hostfile, parse_hosts

logger = logging.getLogger(__name__)

DEFAULT_ELASTIC_TIMEOUT = 600.0
# A discovery command running longer than this (HORA_ELASTIC_DISCOVERY_TIMEOUT) is killed and counts
# as one failed poll.
DISCOVERY_TIMEOUT_SECONDS = float(config.knob("elastic_discovery_timeout").default)


@dataclass(frozen=True)
class ElasticRequest:
    """What an elastic job asks for, with the defaults filled in and checked."""

    settings: ElasticSettings
    discovery: HostDiscovery

    @classmethod
    def build(cls, np: int | None, min_np: int | None, max_np: int | None, hosts: Sequence[Host] | None,
              discovery_script: str | None = None, discovery_function: DiscoveryFunction | None = None,
              slots_per_host: int | None = None, elastic_timeout: float | None = None,
              reset_limit: int | None = None, cooldown_range: Sequence[float] | None = None,
              where: str = "") -> ElasticRequest:
        """``where`` starts every error message (``hora.run``); the command line adds its own."""
        prefix = f"{where}: " if where else ""
        if np is None and min_np is None:
            raise ConfigError(f"{prefix}an elastic job needs -np or --min-np")
        if min_np is not None and max_np is not None and min_np > max_np:
            raise ConfigError(f"{prefix}--min-np {min_np} is greater than --max-np {max_np}")
        start = np if np is not None else min_np
        assert start is not None
        low = min_np if min_np is not None else start
        if cooldown_range is not None:
            if len(cooldown_range) != 2 or cooldown_range[0] > cooldown_range[1] or cooldown_range[0] < 0:
                raise ConfigError(f"{prefix}the blacklist cooldown range needs 0 <= MIN <= MAX, "
                                  f"got {list(cooldown_range)}")
        sources = sum(x is not None for x in (discovery_script, discovery_function, hosts))
        if sources > 1:
            raise ConfigError(f"{prefix}give one source of hosts: a discovery script or function, "
                              "or a host list")
        discovery: HostDiscovery
        if discovery_script is not None:
            discovery = ScriptDiscovery(discovery_script, slots_per_host,
                                        float(config.get("elastic_discovery_timeout")))
        elif discovery_function is not None:
            if not callable(discovery_function):
                raise ConfigError(f"{prefix}discovery must be a script path or a function")
            discovery = FunctionDiscovery(discovery_function, slots_per_host)
        else:
            if slots_per_host is not None:
                raise ConfigError(f"{prefix}--slots-per-host only applies to hosts found by a discovery script")
            discovery = FixedHosts(hosts if hosts is not None else default_hosts(max(start, low, max_np or 0)))
            offered = sum(discovery.find().values())
            if offered < low:
                raise ConfigError(f"{prefix}the hosts offer {offered} slot(s), fewer than --min-np {low}")
        settings = ElasticSettings(
            min_np=low, max_np=max_np, np=start,
            elastic_timeout=DEFAULT_ELASTIC_TIMEOUT if elastic_timeout is None else float(elastic_timeout),
            reset_limit=reset_limit,
            removal_grace=float(config.get("elastic_removal_grace")),
            cooldown_range=None if cooldown_range is None else (float(cooldown_range[0]), float(cooldown_range[1])),
        )
        return cls(settings, discovery)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ElasticRequest:
        hosts = (parse_hosts(args.hosts) if args.hosts is not None
                 else parse_hostfile(args.hostfile) if args.hostfile is not None else None)
        return cls.build(args.np, args.min_np, args.max_np, hosts, discovery_script=args.host_discovery_script,
                         slots_per_host=args.slots_per_host, elastic_timeout=args.elastic_timeout,
                         reset_limit=args.reset_limit, cooldown_range=args.blacklist_cooldown_range)


def _initial_hosts(discovery: HostDiscovery) -> list[Host]:
    """The hosts known before the job starts (they decide where the store listens): one discovery
    attempt; when it fails, this machine only (the driver keeps polling)."""
    try:
        found = discovery.find()
    except DiscoveryError as exc:
        logger.warning("host discovery failed before the job started (retrying every second): %s", exc)
        found = {}
    return [Host(name, slots) for name, slots in found.items()] or [Host("localhost", 1)]


def run_elastic(request: ElasticRequest, command: Sequence[str] | Callable[[SlotInfo], Sequence[str]], *,
                extra_env: Mapping[str, str] | None = None, output_dir: str | None = None,
                stdout: TextIO | None = None, stderr: TextIO | None = None,
                kill_grace: float | None = None, ssh: SshOptions | None = None,
                network_interfaces: Sequence[str] | None = None, timestamps: bool = False,
                handle_signals: bool = False,
                before_start: Callable[[KeyValueStore], None] | None = None,
                before_close: Callable[[KeyValueStore, ElasticOutcome], None] | None = None) -> ElasticOutcome:
    """Run an elastic job to its end.

    ``before_start(store)`` runs once the job's store is up and before any worker starts
    (:func:`hora.run` puts the function there); ``before_close(store, outcome)`` runs after the last
    worker exited, while the store still holds what the workers left (their results).
    """
    hosts = _initial_hosts(request.discovery)
    job = Job(hosts, 1, command, extra_env=extra_env, output_dir=output_dir, stdout=stdout, stderr=stderr,
              kill_grace=kill_grace, ssh=ssh, network_interfaces=network_interfaces, timestamps=timestamps,
              all_hosts=True)
    with job:
        if before_start is not None:
            before_start(job.store)
        driver = ElasticDriver(job, request.discovery, request.settings, handle_signals=handle_signals)
        outcome = driver.run()
        if before_close is not None:
            before_close(job.store, outcome)
    return outcome
