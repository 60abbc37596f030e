"""``hora.run``: run a Python function on N workers (here or over SSH) and collect what each returns.

The function travels through the job's authenticated rendezvous store, each worker runs
:mod:`hora.runner.task`, and results come back the same way. A worker that raised makes
:func:`run` raise *that* exception (same type, with the rank and remote traceback attached), so
``except ValueError`` around ``hora.run`` works as it would around a local call.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Callable, Mapping, Sequence

import cloudpickle

from hora import config
from hora.errors import ConfigError, HoraError, WorkerFailedError
from hora.runner.hosts import default_hosts, parse_hostfile, parse_hosts
from hora.runner.job import Job
from hora.runner.ssh import SshOptions
from hora.runner.launch import JobOutcome
from hora.runner.task import FUNC_KEY, SYS_PATH_KEY, result_key

logger = logging.getLogger(__name__)


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    np: int = 1,
    hosts: str | None = None,
    *,
    hostfile: str | None = None,
    env: Mapping[str, str] | None = None,
    start_timeout: float | None = None,
    verbose: bool = False,
    output_filename: str | None = None,
    executable: str | None = None,
    kill_grace: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    network_interface: str | Sequence[str] | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` workers; return each rank's result in rank order.

    ``hosts`` uses ``-H`` syntax (``"localhost:4"``) and ``hostfile`` a hostfile path; the default
    is ``localhost:np``. ``env`` adds variables to the workers' environment (inherited from this
    process), ``start_timeout`` (seconds) bounds how long workers wait for the job to form,
    ``output_filename`` also writes each rank's output under ``DIR/rank.<N>/``, ``executable`` is
    the Python that runs the workers (default: this one), ``kill_grace`` the seconds between
    SIGTERM and SIGKILL when stopping workers (default: the ``kill_grace`` knob). Hosts other than
    this machine are reached over SSH (``ssh_port``, ``ssh_identity_file``) and must have the same
    Python and hora; ``network_interface`` (``"eth0"``, ``"eth0,ib0"`` or a list; names or
    addresses) is what ``hora run --network-interfaces`` takes.

    The first worker to fail stops the others. Its exception is re-raised here with
    ``exc.hora_rank`` set and the remote traceback in a note (and in ``exc.hora_remote_traceback``);
    an exception that cannot be unpickled becomes a :class:`HoraError` carrying its repr; a worker
    that died without a result (``os._exit``, a signal) raises :class:`WorkerFailedError`.
    """
    if not callable(func):
        raise TypeError(f"hora.run needs a callable, got {type(func).__name__}")
    if hosts is not None and hostfile is not None:
        raise ConfigError("hora.run: give hosts or hostfile, not both")
    host_list = (
        parse_hosts(hosts) if hosts is not None
        else parse_hostfile(hostfile) if hostfile is not None
        else default_hosts(np)
    )
    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    extra_env = {str(key): str(value) for key, value in (env or {}).items()}
    if start_timeout is not None:
        extra_env.update(config.env_for("start_timeout", start_timeout))
    command = [executable or sys.executable, "-m", "hora.runner.task"]
    if isinstance(network_interface, str):
        network_interface = network_interface.split(",")
    interfaces = [name.strip() for name in network_interface or () if name.strip()] or None

    with _verbose_logging(verbose):
        job = Job(host_list, np, command, extra_env=extra_env, output_dir=output_filename,
                  kill_grace=kill_grace, network_interfaces=interfaces,
                  ssh=SshOptions.from_config(port=ssh_port, identity_file=ssh_identity_file))
        with job:
            job.store.set(SYS_PATH_KEY, json.dumps([p for p in sys.path if isinstance(p, str)]).encode())
            job.store.set(FUNC_KEY, payload)
            outcome = job.run(handle_signals=False)
            blobs = {slot.rank: job.store.try_get(result_key(slot.rank)) for slot in job.slots}
            hosts = {slot.rank: slot.hostname for slot in job.slots}
    return _collect(outcome, blobs, hosts)


def _collect(outcome: JobOutcome, blobs: Mapping[int, bytes | None], hosts: Mapping[int, str]) -> list[Any]:
    """Each rank's result, or the exception that stands for the job's first failure."""
    if outcome.failure is not None:
        failure = outcome.failure
        blob = blobs.get(failure.rank)
        if blob is not None:
            decoded = cloudpickle.loads(blob)
            if decoded[0] == "error":
                _raise_remote(failure.rank, failure.host, outcome.size, *decoded[1:])
        raise WorkerFailedError(
            f"{failure.description} before returning a result{outcome.stopped_suffix()}",
            failure.rank, failure.host, failure.returncode,
        )
    results: list[Any] = []
    for rank in range(outcome.size):
        blob = blobs.get(rank)
        if blob is None:
            raise WorkerFailedError(
                f"rank {rank} exited with status 0 without returning a result "
                "(did the function call os._exit?)", rank, hosts[rank], 0,
            )
        try:
            decoded = cloudpickle.loads(blob)
        except Exception as exc:  # noqa: BLE001 - e.g. a class that exists only in the worker
            raise HoraError(f"the result of rank {rank} cannot be unpickled here: {exc!r}; "
                            "return types importable in the calling process") from None
        if decoded[0] == "error":  # a worker that stored an error exits 1; never return it as a value
            _raise_remote(rank, hosts[rank], outcome.size, *decoded[1:])
        results.append(decoded[1])
    return results


def _raise_remote(rank: int, host: str, size: int, exc_blob: bytes | None, text: str,
                  remote_traceback: str) -> None:
    """Re-raise a worker's exception here, as itself when possible."""
    where = f"rank {rank} of {size} on {host}"
    exc: BaseException | None = None
    if exc_blob is not None:
        try:
            exc = cloudpickle.loads(exc_blob)
        except Exception as load_error:  # noqa: BLE001
            text = f"{text} (cannot be unpickled here: {load_error!r})"
    remote = remote_traceback.rstrip()
    if isinstance(exc, BaseException):
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"raised on {where}; remote traceback:\n{remote}")
    else:  # the exception could not travel: say what it was, in the message itself
        exc = HoraError(f"{where} raised {text}, which cannot be sent back as an object; "
                        f"remote traceback:\n{remote}")
    try:
        exc.hora_rank = rank  # type: ignore[attr-defined]
        exc.hora_remote_traceback = remote_traceback  # type: ignore[attr-defined]
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
