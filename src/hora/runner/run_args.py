"""Command-line options of ``hora run``, spelled as ``horovodrun`` users already type them.

Parsing only: the CLI (:mod:`hora.cli`) decides what to do with the result. Engine tuning flags
(``--fusion-threshold-mb``, ``--cycle-time-ms``...) become the workers' ``HORA_*``/``HOROVOD_*``
variables through :func:`knob_environment`, so a flag and an exported variable mean exactly the same
thing. The remote-host options (``-p``, ``-i``, ``--network-interfaces``) configure the SSH launch
of ranks on other hosts (see :mod:`hora.runner.remote`).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from hora import config
from hora.errors import ConfigError
from hora.runner.hosts import Host, default_hosts, parse_hostfile, parse_hosts

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def _number(kind: Callable[[str], Any], minimum: float, strict: bool, what: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return convert


positive_int = _number(int, 0, True, "a positive integer")
nonneg_int = _number(int, 0, False, "a non-negative integer")
positive_float = _number(float, 0.0, True, "a positive number")
nonneg_float = _number(float, 0.0, False, "a non-negative number")


def port_number(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), got {text!r}")
    return value


def log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def interface_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expects a comma-separated list of interface names")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The ``hora run`` parser; its errors print ``hora run: error: ...`` and exit 2."""
    parser = argparse.ArgumentParser(
        prog="hora run",
        usage="hora run -np N [-H host1:slots,... | --hostfile FILE] [options] COMMAND [ARGS...]",
        description="Start N workers of COMMAND, each knowing its rank through HORA_*/HOROVOD_* "
                    "variables; the first worker to fail stops the job.",
        allow_abbrev=False,
    )
    job = parser.add_argument_group("job")
    job.add_argument("-np", "--num-proc", dest="np", type=positive_int, metavar="N",
                     help="number of worker processes (required)")
    hosts = job.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", metavar="HOSTS",
                       help="comma-separated host[:slots] list (slots default to 1); "
                            "default localhost:N")
    hosts.add_argument("--hostfile", "-hostfile", dest="hostfile", metavar="FILE",
                       help="file of 'host slots=N' lines ('#' comments)")
    job.add_argument("--start-timeout", type=positive_float, metavar="SECONDS",
                     help="seconds workers wait for the whole job to check in (default 30)")
    job.add_argument("--output-filename", metavar="DIR",
                     help="also write each rank's output to DIR/rank.<N>/stdout and stderr")
    job.add_argument("--verbose", action="store_true", help="log what the launcher does")
    job.add_argument("--check-build", action="store_true",
                     help="print hora's build and environment (like `hora check`) and exit")

    remote = parser.add_argument_group("remote hosts (ranks on other hosts start over SSH)")
    remote.add_argument("-p", "--ssh-port", type=port_number, metavar="PORT",
                        help="SSH port of the remote hosts")
    remote.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                        help="SSH private key for the remote hosts")
    remote.add_argument("--network-interfaces", type=interface_list, metavar="NICS",
                        help="comma-separated interface names (e.g. eth0) or addresses for worker "
                             "traffic; each host uses the first one it has")

    tuning = parser.add_argument_group("engine tuning (same as the HORA_*/HOROVOD_* variables)")
    tuning.add_argument("--fusion-threshold-mb", type=nonneg_float, metavar="MB",
                        help="tensor fusion buffer in MiB; 0 disables fusion")
    tuning.add_argument("--cycle-time-ms", type=nonneg_float, metavar="MS",
                        help="engine cycle time in milliseconds")
    tuning.add_argument("--cache-capacity", type=nonneg_int, metavar="N",
                        help="response cache entries; 0 disables the cache")
    tuning.add_argument("--hierarchical-allreduce", action="store_true", default=None,
                        help="reduce within each host first, then across hosts")
    tuning.add_argument("--autotune", action="store_true", default=None,
                        help="tune fusion threshold and cycle time while training")
    tuning.add_argument("--autotune-log-file", metavar="FILE", help="CSV log of autotune trials")
    tuning.add_argument("--timeline-filename", metavar="FILE",
                        help="write a Chrome-trace timeline (rank 0) to FILE")
    tuning.add_argument("--timeline-mark-cycles", action="store_true", default=None,
                        help="mark engine cycles in the timeline")
    tuning.add_argument("--no-stall-check", action="store_true", default=None,
                        help="disable the stall inspector")
    tuning.add_argument("--stall-check-warning-time-seconds", type=nonneg_float, metavar="S",
                        help="seconds before a stalled request is reported (default 60)")
    tuning.add_argument("--stall-check-shutdown-time-seconds", type=nonneg_float, metavar="S",
                        help="seconds before a stalled request fails the job (default 0: never)")
    tuning.add_argument("--log-level", type=log_level, metavar="LEVEL",
                        help=f"log level of hora in the workers ({', '.join(LOG_LEVELS)})")

    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="the program each worker runs, with its arguments")
    return parser


# flag destination -> (knob name, conversion of the flag's value to the knob's unit)
_KNOB_FLAGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "start_timeout": ("start_timeout", float),
    "fusion_threshold_mb": ("fusion_threshold", lambda mb: int(round(mb * config.MiB))),
    "cycle_time_ms": ("cycle_time", float),
    "cache_capacity": ("cache_capacity", int),
    "hierarchical_allreduce": ("hierarchical_allreduce", bool),
    "autotune": ("autotune", bool),
    "autotune_log_file": ("autotune_log", str),
    "timeline_filename": ("timeline", str),
    "timeline_mark_cycles": ("timeline_mark_cycles", bool),
    "no_stall_check": ("stall_check_disable", bool),
    "stall_check_warning_time_seconds": ("stall_check_time_seconds", float),
    "stall_check_shutdown_time_seconds": ("stall_shutdown_time_seconds", float),
    "log_level": ("log_level", str),
}


def knob_environment(args: argparse.Namespace) -> dict[str, str]:
    """Workers' environment entries for every tuning flag that was given (both spellings).

    Flags left out add nothing, so a ``HOROVOD_*`` variable the user exported still reaches the
    workers unchanged.
    """
    env: dict[str, str] = {}
    for dest, (knob_name, convert) in _KNOB_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            env.update(config.env_for(knob_name, convert(value)))
    return env


def command_of(args: argparse.Namespace) -> list[str]:
    """The worker command, without a leading ``--`` separator."""
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    return command


def resolve_hosts(args: argparse.Namespace) -> list[Host]:
    """The host list from -H, --hostfile, or the default ``localhost:np``; ConfigError if malformed."""
    if args.hosts is not None:
        return parse_hosts(args.hosts)
    if args.hostfile is not None:
        return parse_hostfile(args.hostfile)
    if args.np is None:
        raise ConfigError("-np is required")
    return default_hosts(args.np)
