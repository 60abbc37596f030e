"""``hora.run``: run a Python function on N workers (here or over SSH) and collect what each returns.

The signature is ``horovod.runner.run``'s, so ``from hora.runner import run`` (or ``hora.run``)
replaces Horovod's without touching the call.

The function travels through the job's authenticated rendezvous store, each worker runs
:mod:`hora.runner.task`, and results come back the same way. A worker that raised makes
:func:`run` raise *that* exception (same type, with the rank and remote traceback attached), so
``except ValueError`` around ``hora.run`` works as it would around a local call.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

from hora import config
from hora.errors import ConfigError, HoraError, WorkerFailedError
from hora.runner.commands.run_args import NO_MPI_CONTROLLER, NO_MPIRUN, UnsupportedOption
from hora.runner.elastic.discovery import DiscoveryFunction
from hora.runner.elastic.driver import ElasticOutcome
from hora.runner.elastic.launch import ElasticRequest, run_elastic
from hora.runner.launching.job import Job
from hora.runner.launching.launch import JobOutcome
from hora.runner.payload import dumps_call
from hora.runner.ssh.options import SshOptions
from hora.runner.task import FUNC_KEY, SYS_PATH_KEY, result_key
from hora.workers.hosts import default_hosts, parse_hostfile, parse_hosts

logger = logging.getLogger(__name__)


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: Sequence[int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | int | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | Sequence[str] | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    kill_grace: float | None = None,
    discovery: str | DiscoveryFunction | None = None,
    elastic_timeout: float | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` workers; return each rank's result in rank order.

    The parameters are ``horovod.runner.run``'s, in its order, so a call written for Horovod works
    unchanged; ``np`` (Horovod's older spelling, and hora's) means ``num_proc``. ``hosts`` uses
    ``-H`` syntax (``"localhost:4"``) and ``hostfile`` a hostfile path; the default is
    ``localhost:num_proc``. ``start_timeout`` (seconds) bounds how long workers wait for the job to
    form, ``output_filename`` also writes each rank's output under ``DIR/rank.<N>/``,
    ``executable`` is the Python that runs the workers (default: this one), ``verbose`` shows the
    runner's log. Hosts other than this machine are reached over SSH (``ssh_port``,
    ``ssh_identity_file``) and must have the same Python and hora; ``network_interface``
    (``"eth0"``, ``"eth0,ib0"`` or a list; names or addresses) is what ``hora run
    --network-interfaces`` takes. ``use_gloo`` and ``disable_cache`` are accepted and change
    nothing (hora's built-in controller is its only one; it caches no start-up checks). What
    ``use_mpi=True`` starts the workers through ``mpirun`` (``mpi_args`` is added to its command
    line; see :mod:`hora.runner.launching.mpi`) instead of hora's own launcher.

    Elastic jobs (docs/elastic.md): giving ``min_num_proc``/``min_np``, ``max_num_proc``/``max_np``
    or ``discovery`` runs the job under the elastic driver, as ``hora run --min-np/--max-np`` does.
    ``slots`` is the slots of a discovered host listed without a count, ``reset_limit`` and
    ``cooldown_range`` (``(min_s, max_s)``) are ``--reset-limit`` and
    ``--blacklist-cooldown-range``. The function should wrap its training in
    ``hvd.elastic.run``; the result list holds one value per rank of the final world.

    Keyword-only additions: ``env`` adds variables to the workers' environment (inherited from this
    process), ``kill_grace`` is the seconds between SIGTERM and SIGKILL when stopping workers
    (default: the ``kill_grace`` knob), ``discovery`` is a host discovery script (a command, as
    ``--host-discovery-script``) or a function returning ``{host: slots}`` that the driver calls
    every second, and ``elastic_timeout`` is ``--elastic-timeout`` (default 600 s).

    The first worker to fail stops the others. Its exception is re-raised here with
    ``exc.hora_rank`` set and the remote traceback in a note (and in ``exc.hora_remote_traceback``);
    an exception that cannot be unpickled becomes a :class:`HoraError` carrying its repr; a worker
    that died without a result (``os._exit``, a signal) raises :class:`WorkerFailedError`.
    """
    if not callable(func):
        raise TypeError(f"hora.run needs a callable, got {type(func).__name__}")
    refuse_unsupported("hora.run", allow_mpi=True, use_gloo=use_gloo, use_mpi=use_mpi, mpi_args=mpi_args)
    low = _same("min_num_proc", min_num_proc, "min_np", min_np)
    high = _same("max_num_proc", max_num_proc, "max_np", max_np)
    elastic = low is not None or high is not None or discovery is not None
    if not elastic:
        for name, value in (("slots", slots), ("reset_limit", reset_limit), ("cooldown_range", cooldown_range),
                            ("elastic_timeout", elastic_timeout)):
            if value is not None:
                raise ConfigError(f"hora.run: {name} only applies to elastic jobs; give min_np/max_np "
                                  "or discovery to make this one elastic")
    size = _resolve_num_proc(num_proc, np) if not (elastic and num_proc is None and np is None and low) \
        else low
    if hosts is not None and hostfile is not None:
        raise ConfigError("hora.run: give hosts or hostfile, not both")
    host_list = (
        parse_hosts(hosts) if hosts is not None
        else parse_hostfile(hostfile) if hostfile is not None
        else default_hosts(size)
    )
    payload = dumps_call(func, args, kwargs)
    extra_env = {str(key): str(value) for key, value in (env or {}).items()}
    if start_timeout is not None:
        extra_env.update(config.env_for("start_timeout", start_timeout))
    command = [executable or sys.executable, "-m", "hora.runner.task"]
    if isinstance(network_interface, str):
        network_interface = network_interface.split(",")
    interfaces = [name.strip() for name in network_interface or () if name.strip()] or None

    if use_mpi and elastic:
        raise ConfigError("hora.run: use_mpi cannot run an elastic job (mpirun's world is fixed); leave "
                          "use_mpi out for elastic jobs")
    if use_mpi:
        with _verbose_logging(bool(verbose)):
            return _run_through_mpirun(host_list, size, command, payload, extra_env, mpi_args, output_filename,
                                       interfaces, SshOptions.from_config(port=ssh_port,
                                                                          identity_file=ssh_identity_file))
    if elastic:
        request = ElasticRequest.build(
            size, low, high,
            parse_hosts(hosts) if hosts is not None
            else parse_hostfile(hostfile) if hostfile is not None else None,
            discovery_script=discovery if isinstance(discovery, str) else None,
            discovery_function=None if isinstance(discovery, str) else discovery,
            slots_per_host=slots, elastic_timeout=elastic_timeout, reset_limit=reset_limit,
            cooldown_range=cooldown_range, where="hora.run")
        with _verbose_logging(bool(verbose)):
            return _run_elastic(request, command, payload, extra_env, output_filename, kill_grace,
                                interfaces, SshOptions.from_config(port=ssh_port, identity_file=ssh_identity_file))
    with _verbose_logging(bool(verbose)):
        if disable_cache or use_gloo:
            logger.info("disable_cache and use_gloo change nothing: hora caches no start-up checks, "
                        "and its built-in controller is its only one")
        job = Job(host_list, size, command, extra_env=extra_env, output_dir=output_filename,
                  kill_grace=kill_grace, network_interfaces=interfaces,
                  ssh=SshOptions.from_config(port=ssh_port, identity_file=ssh_identity_file))
        with job:
            job.store.set(SYS_PATH_KEY, json.dumps([p for p in sys.path if isinstance(p, str)]).encode())
            job.store.set(FUNC_KEY, payload)
            outcome = job.run(handle_signals=False)
            blobs = {slot.rank: job.store.try_get(result_key(slot.rank)) for slot in job.slots}
            hostnames = {slot.rank: slot.hostname for slot in job.slots}
    return _collect(outcome, blobs, hostnames)


def _run_through_mpirun(hosts: Sequence[Any], size: int, command: list[str], payload: bytes,
                        extra_env: dict[str, str], mpi_args: str | None, output_dir: str | None,
                        interfaces: list[str] | None, ssh: SshOptions) -> list[Any]:
    """``use_mpi=True``: mpirun starts the function's workers; results come from the store as usual."""
    from hora.runner.launching.launch import WorkerExit
    from hora.runner.launching.mpi import check_transport, run_job

    check_transport(extra_env, where="hora.run: use_mpi=True")
    job = Job(hosts, size, command, network_interfaces=interfaces, ssh=ssh)
    with job:
        job.store.set(SYS_PATH_KEY, json.dumps([p for p in sys.path if isinstance(p, str)]).encode())
        job.store.set(FUNC_KEY, payload)
        status = run_job(job, hosts, size, command, extra_env, mpi_args, output_dir)
        blobs = {slot.rank: job.store.try_get(result_key(slot.rank)) for slot in job.slots}
        hostnames = {slot.rank: slot.hostname for slot in job.slots}
    outcome = JobOutcome(size=size)
    if status != 0:
        failed = [r for r, b in sorted(blobs.items()) if b is not None and cloudpickle.loads(b)[0] == "error"]
        rank = failed[0] if failed else next((r for r, b in sorted(blobs.items()) if b is None), 0)
        detail = None if failed else f"ended under mpirun, which exited with status {status}"
        outcome.failure = WorkerExit(rank, hostnames[rank], status, detail=detail)
    return _collect(outcome, blobs, hostnames)


def _run_elastic(request: ElasticRequest, command: list[str], payload: bytes, extra_env: dict[str, str],
                 output_dir: str | None, kill_grace: float | None, interfaces: list[str] | None,
                 ssh: SshOptions) -> list[Any]:
    """An elastic :func:`run`: the driver runs the job; results come from the final world's ranks."""
    collected: dict[int, bytes | None] = {}

    def put_function(store: Any) -> None:
        store.set(SYS_PATH_KEY, json.dumps([p for p in sys.path if isinstance(p, str)]).encode())
        store.set(FUNC_KEY, payload)

    def take_results(store: Any, outcome: ElasticOutcome) -> None:
        final = outcome.world
        for rank in range(final.size if final else 0):
            collected[rank] = store.try_get(result_key(rank))

    outcome = run_elastic(request, command, extra_env=extra_env, output_dir=output_dir, kill_grace=kill_grace,
                          ssh=ssh, network_interfaces=interfaces, before_start=put_function,
                          before_close=take_results)
    if outcome.failure is None and outcome.error is not None:
        failures = outcome.failures
        last = failures[-1] if failures else None
        raise WorkerFailedError(f"hora.run: {outcome.message()}", last.rank if last else -1,
                                last.host if last else "", last.returncode if last else 1)
    final = outcome.world
    hostnames = {rank: host for rank, host in (final.members if final else ())}
    return _collect(outcome, collected, hostnames, size=final.size if final else None)


def _same(name: str, value: int | None, alias: str, alias_value: int | None) -> int | None:
    """Horovod's two spellings of one parameter (``min_num_proc``/``min_np``): either, or both equal."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ConfigError(f"hora.run: give {name} or {alias}, not both: {name}={value} and {alias}={alias_value}")
    return value if value is not None else alias_value


def _resolve_num_proc(num_proc: int | None, np: int | None) -> int:
    """``num_proc`` (Horovod's name) or ``np`` (its older one, and hora's); 1 when neither is given."""
    if num_proc is not None and np is not None and num_proc != np:
        raise ConfigError(f"hora.run: give num_proc or np, not both: num_proc={num_proc} and np={np}")
    size = num_proc if num_proc is not None else np if np is not None else 1
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"hora.run: num_proc must be a positive integer, got {size!r}")
    return size


def refuse_unsupported(where: str, allow_mpi: bool = False, **options: Any) -> None:
    """ConfigError naming the first option that asks for something this front end cannot do (the
    rule every function-launching front end shares: hora.run, which starts workers through mpirun
    when asked (``allow_mpi``), and hora.spark.run, whose workers Spark starts)."""
    if options["use_gloo"] and options["use_mpi"]:
        raise ConfigError(f"{where}: use_gloo and use_mpi cannot both be set")
    if options["use_mpi"] and not allow_mpi:
        raise UnsupportedOption(f"{where}: use_mpi: {NO_MPI_CONTROLLER}")
    if options["mpi_args"] is not None and not (allow_mpi and options["use_mpi"]):
        raise UnsupportedOption(f"{where}: mpi_args: {NO_MPIRUN}" if not allow_mpi
                                else f"{where}: mpi_args is given without use_mpi=True; it is mpirun's")


def _collect(outcome: JobOutcome, blobs: Mapping[int, bytes | None], hosts: Mapping[int, str],
             size: int | None = None) -> list[Any]:
    """Each rank's result, or the exception that stands for the job's first failure.

    ``size``: how many ranks returned results, where that differs from the workers the job counted
    (an elastic job counts the worker it started for a round that never formed; its results come
    from the final world alone)."""
    if outcome.failure is not None:
        failure = outcome.failure
        blob = blobs.get(failure.rank)
        if blob is not None:
            decoded = cloudpickle.loads(blob)
            if decoded[0] == "error":
                raise_remote(failure.rank, failure.host, outcome.size, *decoded[1:])
        raise WorkerFailedError(
            f"{failure.description} before returning a result{outcome.stopped_suffix()}",
            failure.rank, failure.host, failure.returncode,
        )
    results: list[Any] = []
    for rank in range(outcome.size if size is None else size):
        blob = blobs.get(rank)
        if blob is None:
            raise WorkerFailedError(
                f"rank {rank} exited with status 0 without returning a result "
                "(did the function call os._exit?)", rank, hosts[rank], 0,
            )
        try:
            decoded = cloudpickle.loads(blob)
        except Exception as exc:  # e.g. a class that exists only in the worker
            raise HoraError(f"the result of rank {rank} cannot be unpickled here: {exc!r}; "
                            "return types importable in the calling process") from None
        if decoded[0] == "error":  # a worker that stored an error exits 1; never return it as a value
            raise_remote(rank, hosts[rank], outcome.size, *decoded[1:])
        results.append(decoded[1])
    return results


def raise_remote(rank: int, host: str, size: int, exc_blob: bytes | None, text: str,
                  remote_traceback: str) -> None:
    """Re-raise a worker's exception here, as itself when possible."""
    where = f"rank {rank} of {size} on {host}"
    exc: BaseException | None = None
    if exc_blob is not None:
        try:
            exc = cloudpickle.loads(exc_blob)
        except Exception as load_error:
            text = f"{text} (cannot be unpickled here: {load_error!r})"
    remote = remote_traceback.rstrip()
    if isinstance(exc, BaseException):
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"raised on {where}; remote traceback:\n{remote}")
    else:  # the exception could not travel: say what it was, in the message itself
        exc = HoraError(f"{where} raised {text}, which cannot be sent back as an object; "
                        f"remote traceback:\n{remote}")
    try:
        exc.hora_rank = rank  # type: ignore[attr-defined]  # hora's own attribute on any exception
        exc.hora_remote_traceback = remote_traceback  # type: ignore[attr-defined]  # the same
    except AttributeError:
        logger.debug("cannot attach the rank to %r", exc)
    raise exc from None


class _verbose_logging:
    """With ``verbose=True``, show the runner's INFO log (starts, exits) on stderr for this call."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._handler: logging.Handler | None = None
        self._previous_level = logging.NOTSET

    def __enter__(self) -> None:
        if not self.enabled:
            return
        runner_logger = logging.getLogger("hora.runner")
        self._previous_level = runner_logger.level
        self._handler = logging.StreamHandler(sys.stderr)
        self._handler.setFormatter(logging.Formatter("hora.run: %(message)s"))
        runner_logger.addHandler(self._handler)
        runner_logger.setLevel(logging.INFO)

    def __exit__(self, *exc: object) -> None:
        if self._handler is not None:
            runner_logger = logging.getLogger("hora.runner")
            runner_logger.removeHandler(self._handler)
            runner_logger.setLevel(self._previous_level)
