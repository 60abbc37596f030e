"""The ``hora`` command: ``hora run`` (what ``horovodrun`` users type), ``hora check``, ``hora bench``.

This is the one place in the runner that prints. Library modules log and raise; here errors found
before any worker starts (a bad value, an unknown option, a Horovod option hora cannot honour yet)
become one line ``hora run: error: ...`` with exit status 2 (argparse's convention), and the end of
a failed job becomes one line naming the rank, its host, its exit status and, when the rank died
from a Python exception, that exception.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import hora
from hora.errors import ConfigError, LaunchError

logger = logging.getLogger(__name__)

USAGE = """\
usage: hora <command> [options]

commands:
  run     start N workers of a command:  hora run -np 4 python train.py
  check   show hora's version, transports, frameworks and configuration
  bench   run hora's benchmarks:          hora bench --help
  timeline  summarise a timeline:         hora timeline trace.json [--plot out.png]
  discover  print host:slots lines:       hora discover kubernetes --service NAME --slots N

`hora <command> --help` describes each command's options.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hora`` console script; returns the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(args)
    except SystemExit as exc:  # argparse's way of reporting usage errors and --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def _dispatch(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    if args[0] == "--version":
        print(f"hora {hora.__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "run":
        return run_main(rest)
    if command == "check":
        return check_main(rest)
    if command == "bench":
        return bench_main(rest)
    if command == "timeline":
        from hora.timeline_report import main as timeline_main
        return timeline_main(rest)
    if command == "discover":
        from hora.runner.commands.discover import main as discover_main
        return discover_main(rest)
    print(f"hora: error: unknown command {command!r} (choose from run, check, bench, timeline, discover)",
          file=sys.stderr)
    sys.stderr.write(USAGE)
    return 2


def check_main(args: Sequence[str]) -> int:
    """``hora check``: print what is installed and configured."""
    if any(arg in ("-h", "--help") for arg in args):
        print("usage: hora check\n\nPrint hora's version, transports, frameworks and configuration.")
        return 0
    if args:
        print(f"hora check: error: unexpected arguments: {' '.join(args)}", file=sys.stderr)
        return 2
    from hora.runner.commands.check import report_lines

    print("\n".join(report_lines()))
    return 0


def bench_main(args: Sequence[str]) -> int:
    """``hora bench ARGS...``: hand over to :func:`hora.bench.cli.main` (owned by the bench module)."""
    try:
        from hora.bench.cli import main as bench_cli_main
    except ModuleNotFoundError as exc:
        if exc.name not in ("hora.bench", "hora.bench.cli"):
            raise  # the benchmarks exist but something they need is missing: show it
        print("hora bench: error: the benchmarks are not available in this install "
              "(hora.bench.cli is missing)", file=sys.stderr)
        return 1
    return int(bench_cli_main(list(args)) or 0)


def _configure_logging(verbose: bool, level_name: str | None) -> None:
    level = logging.INFO if verbose else logging.WARNING
    if level_name:
        level = min(level, {"TRACE": logging.DEBUG, "FATAL": logging.CRITICAL}.get(
            level_name, getattr(logging, level_name, logging.WARNING)))
    logging.basicConfig(level=level, format="hora run: %(message)s", stream=sys.stderr)


def _usage_error(message: str) -> int:
    """One line, argparse's exit status: the launch stops before anything started."""
    print(f"hora run: error: {message}", file=sys.stderr)
    return 2


def run_main(argv: Sequence[str]) -> int:
    """``hora run``: parse, validate, launch, and report how the job ended."""
    from hora.runner.commands.run_args import (
        UsageError,
        is_elastic,
        knob_environment,
        notes,
        parse_run_args,
        resolve_hosts,
    )
    from hora.runner.launching.job import Job
    from hora.runner.ssh.options import SshOptions

    try:
        args = parse_run_args(argv)
    except UsageError as exc:
        return _usage_error(str(exc))
    if args.check_build:
        return check_main([])
    elastic = is_elastic(args)
    if args.mpi_args is not None and not args.use_mpi:
        return _usage_error("--mpi-args is passed to mpirun, so it needs --mpi")
    if args.use_mpi and elastic:
        return _usage_error("--mpi cannot run an elastic job (mpirun's world is fixed); leave out --mpi")
    if args.np is None and not (elastic and args.min_np is not None):
        return _usage_error("-np/--num-proc is required (the number of workers to start)")
    command = args.command
    if not command:
        return _usage_error("missing the command to run, e.g. hora run -np 2 python train.py")
    _configure_logging(bool(args.verbose), args.log_level)
    if elastic:
        return _run_elastic(args, command)
    for note in notes(args):
        logger.info("%s", note)
    try:
        if args.use_mpi:
            from hora.runner.launching.mpi import check_transport

            check_transport(knob_environment(args))
        hosts = resolve_hosts(args)
        ssh = SshOptions.from_config(port=args.ssh_port, identity_file=args.ssh_identity_file)
        job = Job(hosts, args.np, command, extra_env=knob_environment(args),
                  output_dir=args.output_filename, ssh=ssh,
                  network_interfaces=args.network_interfaces,
                  timestamps=bool(args.prefix_output_with_timestamp))
    except (ConfigError, LaunchError) as exc:
        return _usage_error(str(exc))
    if not job.remote_hosts and (args.ssh_port is not None or args.ssh_identity_file is not None):
        logger.info("-p/-i (SSH options) are not needed: every rank of this job runs on this host")
    for slot in job.slots:
        logger.info("rank %d on %s: local rank %d of %d, cross rank %d of %d", slot.rank,
                    slot.hostname, slot.local_rank, slot.local_size, slot.cross_rank, slot.cross_size)
    if args.use_mpi:
        from hora.runner.launching.mpi import run_job

        try:
            with job:
                return run_job(job, hosts, args.np, command, knob_environment(args), args.mpi_args,
                               args.output_filename)
        except LaunchError as exc:
            print(f"hora run: error: {exc}", file=sys.stderr)
            return 1
    try:
        with job:
            outcome = job.run(handle_signals=True)
    except LaunchError as exc:
        print(f"hora run: error: {exc}", file=sys.stderr)
        return 1
    message = outcome.message()
    if message:
        print(f"hora run: {message}", file=sys.stderr, flush=True)
    return outcome.exit_code


def _run_elastic(args: argparse.Namespace, command: Sequence[str]) -> int:
    """``hora run`` with --min-np/--max-np/--host-discovery-script: the elastic driver runs the job."""
    from hora.runner.commands.run_args import knob_environment, notes
    from hora.runner.elastic.launch import ElasticRequest, run_elastic
    from hora.runner.ssh.options import SshOptions

    for note in notes(args):
        logger.info("%s", note)
    try:
        request = ElasticRequest.from_args(args)
        ssh = SshOptions.from_config(port=args.ssh_port, identity_file=args.ssh_identity_file)
        outcome = run_elastic(request, command, extra_env=knob_environment(args),
                              output_dir=args.output_filename, ssh=ssh,
                              network_interfaces=args.network_interfaces,
                              timestamps=bool(args.prefix_output_with_timestamp), handle_signals=True)
    except (ConfigError, LaunchError) as exc:
        return _usage_error(str(exc))
    message = outcome.message()
    if message:
        print(f"hora run: {message}", file=sys.stderr, flush=True)
    return outcome.exit_code
