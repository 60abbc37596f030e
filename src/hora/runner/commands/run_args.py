"""Command-line options of ``hora run``: every flag of ``horovodrun`` 0.28.1, spelled the same.

Parsing only: the CLI (:mod:`hora.cli`) decides what to do with the result. A migrating user's
command line must never be half-understood, so each Horovod flag falls into one of three kinds:

- it works: engine tuning flags (``--fusion-threshold-mb``, ``--cycle-time-ms``...) become the
  workers' ``HORA_*``/``HOROVOD_*`` variables through :func:`knob_environment`, so a flag and an
  exported variable mean exactly the same thing; launcher flags (``-H``, ``-p``,
  ``--network-interface``, ``--prefix-output-with-timestamp``...) change how workers start;
- it asks for something hora already does, or never does (``--gloo``: hora's built-in controller
  is the only one; ``--disable-cache``: hora caches no start-up checks; ``--mpi-threads-disable``:
  hora uses no MPI threads). It is accepted, and ``--verbose`` says why it changes nothing;
- it asks for something hora does not have yet (MPI, jsrun, NCCL streams...). Then
  :func:`parse_run_args` raises :class:`UnsupportedOption`, one line that names the flag and says
  why, before any worker starts.

``--config-file`` reads Horovod's YAML schema (``controller``, ``params``, ``autotune``,
``timeline``, ``stall_check``, ``library_options``, ``logging``) into the same options, so every
setting there obeys the same three rules; flags given on the command line win over the file.
An unknown flag is named, with the nearest known spelling when there is one.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from hora import config
from hora.errors import ConfigError
from hora.version import __version__
from hora.workers.hosts import Host, default_hosts, parse_hostfile, parse_hosts

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


class UsageError(ConfigError):
    """A command line ``hora run`` cannot use; the message is the one line to show the user."""


class UnsupportedOption(UsageError):
    """A Horovod option that asks for something hora does not have yet."""


def _number(kind: Callable[[Any], Any], minimum: float, strict: bool, what: str) -> Callable[[Any], Any]:
    def convert(text: Any) -> Any:  # a command line's string, or a config file's value
        try:
            value = kind(text)
        except (TypeError, ValueError):
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
    level = str(text).strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def unit_interval(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def compression_choice(text: str) -> str:
    """``--compression``'s value in HORA_COMPRESSION's canonical spelling (the knob's own grammar)."""
    try:
        return str(config.knob("compression").parse(str(text)))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def interface_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expects a comma-separated list of interface names")
    return names


class _AddInterfaces(argparse.Action):
    """``--network-interfaces a,b`` and repeated ``--network-interface a``: one ordered list."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        names = list(getattr(namespace, self.dest, None) or [])
        names += [name for name in values if name not in names]
        setattr(namespace, self.dest, names)


class _Parser(argparse.ArgumentParser):
    """argparse, but every problem is one ``hora run: error: ...`` line (raised, not printed)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``hora run`` parser: every ``horovodrun`` 0.28.1 option, none of them defaulted.

    Every option defaults to None, so "given on the command line" is "not None": that is how
    :func:`parse_run_args` lets the command line win over ``--config-file``. Parse errors raise
    :class:`UsageError`.
    """
    parser = _Parser(
        prog="hora run",
        usage="hora run -np N [-H host1:slots,... | --hostfile FILE] [options] COMMAND [ARGS...]",
        description="Start N workers of COMMAND, each knowing its rank through HORA_*/HOROVOD_* "
                    "variables; the first worker to fail stops the job. Every horovodrun flag is "
                    "accepted: those hora cannot honour yet stop the launch with a line saying why.",
        allow_abbrev=False,
    )

    parser.add_argument("-v", "--version", action="version", version=f"hora {__version__}",
                        help="print hora's version and exit")
    job = parser.add_argument_group("job")
    job.add_argument("-np", "--num-proc", dest="np", type=positive_int, metavar="N",
                     help="number of worker processes (required)")
    job.add_argument("-cb", "--check-build", action="store_true", default=None,
                     help="print hora's build and environment (like `hora check`) and exit")
    job.add_argument("--disable-cache", action="store_true", default=None,
                     help="accepted: hora keeps no cache of its start-up checks, every run checks again")
    job.add_argument("--start-timeout", type=positive_float, metavar="SECONDS",
                     help="seconds workers wait for the whole job to check in (default 30)")
    job.add_argument("--output-filename", metavar="DIR",
                     help="also write each rank's output to DIR/rank.<N>/stdout and stderr")
    job.add_argument("--verbose", action="store_true", default=None, help="log what the launcher does")
    job.add_argument("--config-file", metavar="FILE",
                     help="YAML file in horovodrun's schema (params, timeline, stall_check, logging...); "
                          "flags on the command line win over it")

    hosts = parser.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", metavar="HOSTS",
                       help="comma-separated host[:slots] list (slots default to 1); "
                            "default localhost:N")
    hosts.add_argument("-hostfile", "--hostfile", dest="hostfile", metavar="FILE",
                       help="file of 'host slots=N' lines ('#' comments)")
    hosts.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="elastic training: a command printing the usable hosts, one host:slots "
                            "per line; run every second")

    remote = parser.add_argument_group("remote hosts (ranks on other hosts start over SSH)")
    remote.add_argument("-p", "--ssh-port", type=port_number, metavar="PORT",
                        help="SSH port of the remote hosts")
    remote.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                        help="SSH private key for the remote hosts")
    remote.add_argument("--network-interfaces", dest="network_interfaces", type=interface_list,
                        action=_AddInterfaces, metavar="NICS",
                        help="comma-separated interface names (e.g. eth0) or addresses for worker "
                             "traffic; each host uses the first one it has")
    remote.add_argument("--network-interface", dest="network_interfaces", type=interface_list,
                        action=_AddInterfaces, metavar="NIC",
                        help="one more interface for --network-interfaces (may be repeated)")

    tuning = parser.add_argument_group("engine tuning (same as the HORA_*/HOROVOD_* variables)")
    tuning.add_argument("--fusion-threshold-mb", type=nonneg_float, metavar="MB",
                        help="tensor fusion buffer in MiB; 0 disables fusion")
    tuning.add_argument("--cycle-time-ms", type=nonneg_float, metavar="MS",
                        help="engine cycle time in milliseconds")
    tuning.add_argument("--cache-capacity", type=nonneg_int, metavar="N",
                        help="response cache entries; 0 disables the cache")
    tuning.add_argument("--compression", type=compression_choice, metavar="NAME[:OPTIONS]",
                        help="compression of every gradient wrapper (DistributedOptimizer, "
                             "DistributedGradientTape) the script builds without a compression argument: "
                             "none, fp16, bf16, powersgd[:RANK[:START_ITER]] or topk[:RATIO], e.g. powersgd:4 "
                             "or topk:0.01 (PowerSGD and top-k: hora.torch.DistributedOptimizer only); sets "
                             "HORA_COMPRESSION. hora's, not horovodrun's")
    allreduce = tuning.add_mutually_exclusive_group()
    allreduce.add_argument("--hierarchical-allreduce", action="store_true", default=None,
                           help="reduce within each host first, then across hosts")
    allreduce.add_argument("--no-hierarchical-allreduce", dest="hierarchical_allreduce",
                           action="store_false", default=None,
                           help="plain allreduce (the default), even if the environment asks otherwise")
    allgather = tuning.add_mutually_exclusive_group()
    allgather.add_argument("--hierarchical-allgather", action="store_true", default=None,
                           help="not built yet, refused")
    allgather.add_argument("--no-hierarchical-allgather", dest="hierarchical_allgather",
                           action="store_false", default=None,
                           help="accepted: hora's allgather is never hierarchical")

    autotune = parser.add_argument_group(
        "autotune (tunes the knobs not set explicitly while the job trains; needs scikit-learn)")
    enabled = autotune.add_mutually_exclusive_group()
    enabled.add_argument("--autotune", action="store_true", default=None,
                         help="tune fusion threshold, cycle time, the response cache and hierarchical "
                              "allreduce by Bayesian optimisation during the first steps")
    enabled.add_argument("--no-autotune", dest="autotune", action="store_false", default=None,
                         help="no autotuning (the default)")
    autotune.add_argument("--autotune-log-file", metavar="FILE",
                          help="CSV of every setting tried and its score (rank 0); the last row is the best")
    autotune.add_argument("--autotune-warmup-samples", type=nonneg_int, metavar="N",
                          help="samples discarded at the start (default 3)")
    autotune.add_argument("--autotune-steps-per-sample", type=nonneg_int, metavar="N",
                          help="training steps per sample (default 10)")
    autotune.add_argument("--autotune-bayes-opt-max-samples", type=nonneg_int, metavar="N",
                          help="settings of fusion threshold and cycle time tried (default 20)")
    autotune.add_argument("--autotune-gaussian-process-noise", type=unit_interval, metavar="X",
                          help="noise (alpha) of the Gaussian process (default 0.8)")

    elastic = parser.add_argument_group(
        "elastic training (on with --min-np, --max-np or --host-discovery-script; docs/elastic.md)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=positive_int, metavar="N",
                         help="fewest workers to train with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=positive_int, metavar="N",
                         help="most workers to train with (default: as many slots as the hosts offer)")
    elastic.add_argument("--slots-per-host", dest="slots_per_host", type=positive_int, metavar="N",
                         help="slots of a discovered host printed without a count (default 1)")
    elastic.add_argument("--elastic-timeout", type=positive_float, metavar="SECONDS",
                         help="how long to wait for --min-np slots, or for a world to form (default 600)")
    elastic.add_argument("--reset-limit", type=nonneg_int, metavar="N",
                         help="stop after the world was re-formed N times (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", type=nonneg_int, nargs=2, metavar=("MIN", "MAX"),
                         help="a failed host returns after MIN*2^(failures-1) s, at most MAX s "
                              "(default: never)")

    timeline = parser.add_argument_group("timeline")
    timeline.add_argument("--timeline-filename", metavar="FILE",
                          help="write a Chrome-trace timeline (rank 0) to FILE")
    cycles = timeline.add_mutually_exclusive_group()
    cycles.add_argument("--timeline-mark-cycles", action="store_true", default=None,
                        help="mark engine cycles in the timeline")
    cycles.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles",
                        action="store_false", default=None, help="do not mark engine cycles")

    stall = parser.add_argument_group("stall check")
    stall_enabled = stall.add_mutually_exclusive_group()
    stall_enabled.add_argument("--no-stall-check", action="store_true", default=None,
                               help="disable the stall inspector")
    stall_enabled.add_argument("--stall-check", dest="no_stall_check", action="store_false",
                               default=None, help="keep the stall inspector on (the default)")
    stall.add_argument("--stall-check-warning-time-seconds", type=nonneg_float, metavar="S",
                       help="seconds before a stalled request is reported (default 60)")
    stall.add_argument("--stall-check-shutdown-time-seconds", type=nonneg_float, metavar="S",
                       help="seconds before a stalled request fails the job (default 0: never)")

    library = parser.add_argument_group("library options")
    threads = library.add_mutually_exclusive_group()
    threads.add_argument("--mpi-threads-disable", action="store_true", default=None,
                         help="accepted: hora leaves MPI's thread level as mpi4py sets it (MULTIPLE)")
    threads.add_argument("--no-mpi-threads-disable", dest="mpi_threads_disable",
                         action="store_false", default=None, help="accepted: MPI_THREAD_MULTIPLE is kept")
    library.add_argument("--mpi-args", metavar="ARGS",
                         help="with --mpi: extra arguments for mpirun, added before the command")
    library.add_argument("--tcp", action="store_true", default=None,
                         help="TCP only: hora never uses InfiniBand; sets NCCL_IB_DISABLE=1 as Horovod does")
    library.add_argument("--binding-args", metavar="ARGS", help="refused: hora does not use mpirun")
    library.add_argument("--num-nccl-streams", type=nonneg_int, metavar="N",
                         help="refused: hora has no NCCL support yet")
    library.add_argument("--thread-affinity", type=nonneg_int, metavar="CORE",
                         help="refused: hora does not pin its background thread")
    library.add_argument("--gloo-timeout-seconds", type=positive_float, metavar="S",
                         help="seconds a collective may wait on a peer (hora's transport timeout, default 30)")

    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", type=log_level, metavar="LEVEL",
                      help=f"log level of hora in the workers ({', '.join(LOG_LEVELS)})")
    stamps = logs.add_mutually_exclusive_group()
    stamps.add_argument("--log-with-timestamp", dest="log_with_timestamp", action="store_true",
                        default=None, help="refused: hora's log lines carry no timestamp")
    stamps.add_argument("--log-without-timestamp", dest="log_with_timestamp", action="store_false",
                        default=None, help="accepted: hora's log lines carry no timestamp")
    stamps.add_argument("--log-hide-timestamp", dest="log_with_timestamp", action="store_false",
                        default=None, help=argparse.SUPPRESS)
    stamps.add_argument("--no-log-hide-timestamp", dest="log_with_timestamp", action="store_true",
                        default=None, help=argparse.SUPPRESS)
    stamps.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                        dest="prefix_output_with_timestamp", action="store_true", default=None,
                        help="start every forwarded line of worker output with the time it arrived")

    controller = parser.add_argument_group("controller").add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="use_gloo", action="store_true", default=None,
                            help="accepted: hora's built-in controller (its only one) plays Gloo's part")
    controller.add_argument("--mpi", dest="use_mpi", action="store_true", default=None,
                            help="start the workers through mpirun (Open MPI or MPICH), as Horovod's --mpi")
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true", default=None,
                            help="refused: hora does not launch through jsrun")

    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="the program each worker runs, with its arguments")
    return parser


# ---- what hora cannot honour yet -------------------------------------------------------------------

# Why hora refuses what it does not have yet; shared with hora.run (:mod:`hora.runner.api`).
NO_MPI_CONTROLLER = ("its workers are started by its own launcher, not mpirun; hora's built-in "
                     "controller (the one --gloo and use_gloo name) runs them (hora.run and hora run "
                     "take use_mpi/--mpi)")
NO_MPIRUN = "its workers are not started through mpirun, so there is nothing to pass MPI arguments to"
_ELASTIC_ONLY = ("only applies to elastic jobs; add --min-np/--max-np or --host-discovery-script "
                 "to make this one elastic")
_NO_TIMESTAMPS = ("hora's log lines carry no timestamp; "
                  "use --prefix-output-with-timestamp to timestamp every line of worker output")

# dest -> (value that is refused, or None for "any value", why). Checked in this order.
_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("slots_per_host", None, _ELASTIC_ONLY),
    ("elastic_timeout", None, _ELASTIC_ONLY),
    ("reset_limit", None, _ELASTIC_ONLY),
    ("blacklist_cooldown_range", None, _ELASTIC_ONLY),
    ("use_jsrun", True, "hora cannot start workers through jsrun (LSF); list the hosts with "
                        "-H or --hostfile and hora starts them itself"),
    ("binding_args", None, "process binding is done by mpirun or jsrun, which hora does not use; "
                           "bind inside the command instead (e.g. taskset or numactl)"),
    ("num_nccl_streams", None, "hora runs every NCCL collective of a process on one CUDA stream of "
                               "its own (Horovod's default of 1), ordered after the framework's with "
                               "events; more streams are not supported, so leave the flag out"),
    ("thread_affinity", None, "hora does not pin its background thread to a core; pin the whole "
                              "worker instead (e.g. taskset)"),
    ("hierarchical_allgather", True, "hora has no hierarchical allgather yet; its allgather "
                                     "gives the same result without it, so leave the flag out"),
    ("log_with_timestamp", True, _NO_TIMESTAMPS),
)

# dest -> (value, why it changes nothing): said under --verbose.
_ALREADY_SO: tuple[tuple[str, Any, str], ...] = (
    ("disable_cache", True, "hora keeps no cache of its start-up checks; every run checks again"),
    ("use_gloo", True, "hora's built-in controller, its only one, plays Gloo's part"),
    ("mpi_threads_disable", None, "hora's MPI transport needs MPI_THREAD_MULTIPLE (its engine thread calls MPI "
                                  "while the script may too), so hora leaves the thread level as mpi4py sets it"),
    ("hierarchical_allgather", False, "hora's allgather is never hierarchical"),
    ("log_with_timestamp", False, "hora's log lines carry no timestamp"),
)


def _flag_name(parser: argparse.ArgumentParser, dest: str, value: Any) -> str:
    """The flag spelling that sets ``dest`` to ``value`` (``--min-np/--min-num-proc``)."""
    fallback = None
    for action in parser._actions:
        if action.dest != dest or not action.option_strings:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if action.const is value and action.help != argparse.SUPPRESS:
                return "/".join(action.option_strings)
            continue
        fallback = fallback or "/".join(action.option_strings)
    return fallback or "--" + dest.replace("_", "-")


def check_supported(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
    """Raise :class:`UnsupportedOption` for the first option hora cannot honour yet."""
    parser = parser or build_parser()
    sources: dict[str, str] = getattr(args, "config_sources", {})
    elastic = is_elastic(args)
    for dest, refused, why in _REFUSED:
        value = getattr(args, dest, None)
        if value is None or (refused is not None and value is not refused):
            continue
        if why is _ELASTIC_ONLY and elastic:
            continue
        where = sources.get(dest) or _flag_name(parser, dest, value)
        raise UnsupportedOption(f"{where}: {why}")


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the command line asks for an elastic job (as horovodrun decides it)."""
    return any(getattr(args, dest, None) is not None for dest in ("min_np", "max_np", "host_discovery_script"))


def notes(args: argparse.Namespace) -> list[str]:
    """Why each accepted no-op option changes nothing (for ``--verbose``)."""
    found = []
    parser: argparse.ArgumentParser | None = None
    sources: dict[str, str] = getattr(args, "config_sources", {})
    for dest, value, why in _ALREADY_SO:
        given = getattr(args, dest, None)
        if given is not None and (value is None or given is value):
            parser = parser or build_parser()
            found.append(f"{sources.get(dest) or _flag_name(parser, dest, given)}: {why}")
    return found


# ---- --config-file ----------------------------------------------------------------------------------

def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise argparse.ArgumentTypeError(f"must be true or false, got {value!r}")


def _text(value: Any) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value):
        return str(value)
    raise argparse.ArgumentTypeError(f"must be a string, got {value!r}")


def _nonneg_number(value: Any) -> float:
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {value!r}")
    return nonneg_float(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value!r}")
    return nonneg_int(value)


def _positive_number(value: Any) -> float:
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value!r}")
    return positive_float(value)


def _not(convert: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: not convert(value)


# section -> key -> (dest, conversion). Horovod's config-file schema, section by section.
_CONFIG_SCHEMA: dict[str, dict[str, tuple[str, Callable[[Any], Any]]]] = {
    "params": {
        "fusion_threshold_mb": ("fusion_threshold_mb", _nonneg_number),
        "cycle_time_ms": ("cycle_time_ms", _nonneg_number),
        "cache_capacity": ("cache_capacity", _count),
        "hierarchical_allreduce": ("hierarchical_allreduce", _boolean),
        "hierarchical_allgather": ("hierarchical_allgather", _boolean),
    },
    "autotune": {
        "enabled": ("autotune", _boolean),
        "log_file": ("autotune_log_file", _text),
        "warmup_samples": ("autotune_warmup_samples", _count),
        "steps_per_sample": ("autotune_steps_per_sample", _count),
        "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", _count),
        "gaussian_process_noise": ("autotune_gaussian_process_noise", unit_interval),
    },
    "timeline": {
        "filename": ("timeline_filename", _text),
        "mark_cycles": ("timeline_mark_cycles", _boolean),
    },
    "stall_check": {
        "enabled": ("no_stall_check", _not(_boolean)),
        "warning_time_seconds": ("stall_check_warning_time_seconds", _nonneg_number),
        "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", _nonneg_number),
    },
    "library_options": {
        "mpi_threads_disable": ("mpi_threads_disable", _boolean),
        "num_nccl_streams": ("num_nccl_streams", _count),
        "thread_affinity": ("thread_affinity", _count),
        "ccl_bgt_affinity": ("thread_affinity", _count),
        "gloo_timeout_seconds": ("gloo_timeout_seconds", _positive_number),
    },
    "logging": {
        "level": ("log_level", log_level),
        "with_timestamp": ("log_with_timestamp", _boolean),
    },
}


def _load_yaml(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise UsageError(f"--config-file: cannot read {path}: {exc.strerror or exc}") from None
    try:
        import yaml  # optional: only --config-file needs it
    except ImportError:
        raise UsageError(f"--config-file {path}: reading YAML needs PyYAML "
                         "(pip install pyyaml, or pip install 'hora[yaml]')") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise UsageError(f"--config-file {path}: is not valid YAML{line}: "
                         f"{getattr(exc, 'problem', None) or exc}") from None


def apply_config_file(args: argparse.Namespace, path: str) -> None:
    """Fill the options the command line left unset from a ``horovodrun --config-file`` YAML file.

    Records where each value came from in ``args.config_sources`` so a refusal names the file's
    key rather than a flag the user never typed. Unknown sections and keys are errors: a typo in
    a tuning file would otherwise be a setting that silently does nothing.
    """
    document = _load_yaml(path)
    prefix = f"--config-file {path}"
    if document is None:
        return
    if not isinstance(document, dict):
        raise UsageError(f"{prefix}: must hold a mapping of sections (params, timeline, ...), "
                         f"got {type(document).__name__}")
    sources: dict[str, str] = args.__dict__.setdefault("config_sources", {})
    for section, body in document.items():
        if section == "controller":
            choice = str(body).strip().lower()
            if choice not in ("gloo", "mpi"):
                raise UsageError(f"{prefix}: controller: must be gloo or mpi, got {body!r}")
            if args.use_gloo is None and args.use_mpi is None and args.use_jsrun is None:
                dest = "use_gloo" if choice == "gloo" else "use_mpi"
                setattr(args, dest, True)
                sources[dest] = f"{prefix}: controller"
            continue
        schema = _CONFIG_SCHEMA.get(section)
        if schema is None:
            known = ", ".join(["controller", *_CONFIG_SCHEMA])
            raise UsageError(f"{prefix}: {section}: unknown section (known: {known})")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise UsageError(f"{prefix}: {section}: must be a mapping of settings, got {body!r}")
        for key, value in body.items():
            if key not in schema:
                raise UsageError(f"{prefix}: {section}.{key}: unknown setting "
                                 f"(known in {section}: {', '.join(schema)})")
            if value is None:
                continue
            dest, convert = schema[key]
            try:
                converted = convert(value)
            except argparse.ArgumentTypeError as exc:
                raise UsageError(f"{prefix}: {section}.{key}: {exc}") from None
            if getattr(args, dest, None) is None:  # the command line wins
                setattr(args, dest, converted)
                sources[dest] = f"{prefix}: {section}.{key}"


# ---- the whole command line -------------------------------------------------------------------------

def _unknown_option_message(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    option = next((item for item in unknown if item.startswith("-")), unknown[0])
    name = option.split("=", 1)[0]
    message = f"unknown option {name}"
    close = difflib.get_close_matches(name, list(parser._option_string_actions), n=1, cutoff=0.75)
    if close:
        message += f" (did you mean {close[0]}?)"
    return (f"{message}; hora run takes horovodrun's options (`hora run --help` lists them), "
            "and the worker command comes after them")


def parse_run_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a ``hora run`` command line, apply ``--config-file`` and refuse what hora cannot do.

    Raises :class:`UsageError` (one line) for anything wrong, :class:`UnsupportedOption` for a
    Horovod option hora does not have yet. ``args.command`` is the worker command without a
    leading ``--``. ``--help`` and ``--version`` print and raise SystemExit(0), as argparse does.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(list(argv))
    if unknown:
        raise UsageError(_unknown_option_message(parser, unknown))
    args.command = command_of(args)
    if args.config_file is not None:
        apply_config_file(args, args.config_file)
    check_supported(args, parser)
    return args


# flag destination -> (knob name, conversion of the flag's value to the knob's unit)
_KNOB_FLAGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "start_timeout": ("start_timeout", float),
    "fusion_threshold_mb": ("fusion_threshold", lambda mb: int(round(mb * config.MiB))),
    "cycle_time_ms": ("cycle_time", float),
    "cache_capacity": ("cache_capacity", int),
    "compression": ("compression", str),
    "hierarchical_allreduce": ("hierarchical_allreduce", bool),
    "autotune": ("autotune", bool),
    "autotune_log_file": ("autotune_log", str),
    "autotune_warmup_samples": ("autotune_warmup_samples", int),
    "autotune_steps_per_sample": ("autotune_steps_per_sample", int),
    "autotune_bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", int),
    "autotune_gaussian_process_noise": ("autotune_gaussian_process_noise", float),
    "timeline_filename": ("timeline", str),
    "timeline_mark_cycles": ("timeline_mark_cycles", bool),
    "no_stall_check": ("stall_check_disable", bool),
    "stall_check_warning_time_seconds": ("stall_check_time_seconds", float),
    "stall_check_shutdown_time_seconds": ("stall_shutdown_time_seconds", float),
    "log_level": ("log_level", str),
    "gloo_timeout_seconds": ("transport_timeout", float),
}


def knob_environment(args: argparse.Namespace) -> dict[str, str]:
    """Workers' environment entries for every tuning option that was given (both spellings).

    Options left out add nothing, so a ``HOROVOD_*`` variable the user exported still reaches the
    workers unchanged. ``--tcp`` sets ``NCCL_IB_DISABLE=1``, as horovodrun does.
    """
    env: dict[str, str] = {}
    for dest, (knob_name, convert) in _KNOB_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            env.update(config.env_for(knob_name, convert(value)))
    if getattr(args, "tcp", None):
        env["NCCL_IB_DISABLE"] = "1"
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
