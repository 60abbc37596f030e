"""``hora.spark.run``: one hora job whose workers are the tasks of a Spark barrier stage.

horovod.spark's ``run`` with the same arguments. The driver (the process that calls it) serves the
job's rendezvous store with a fresh secret on the address Spark's executors reach
(``spark.driver.host``), then runs a one-stage job of ``num_proc`` partitions in barrier execution
mode, so Spark starts all the tasks together or none (:mod:`hora.spark.task` is what each task runs).
The function travels through the store, not inside Spark's closure, and each task's outcome comes
back as its partition's element.

Bounds, so nothing waits for ever:
- ``start_timeout`` (else ``HORA_SPARK_START_TIMEOUT``/``HOROVOD_SPARK_START_TIMEOUT``, else 600 s):
  every task must have started by then, or the Spark job is cancelled and the call fails naming the
  task slots the cluster has;
- a Spark stage retry (Spark restarts every task of a barrier stage when one is lost) cancels the job
  at once: a hora world cannot be resumed by new tasks (``run_elastic`` can);
- once started, the job runs as long as the function does; a rank that fails makes the others'
  collectives fail, and the call raises that rank's exception.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TextIO

import cloudpickle

from hora import config
from hora.errors import ConfigError, HorovodInternalError, LaunchError
from hora.rendezvous import RendezvousServer, new_secret
from hora.runner.api import raise_remote, refuse_unsupported
from hora.runner.launching.worker_env import JobContext
from hora.runner.payload import dumps_call
from hora.spark.task import FUNC_KEY, KEY_PREFIX, SYS_PATH_KEY, TaskSpec, output_prefix, run_task

logger = logging.getLogger(__name__)

_POLL_S = 0.1
_CANCEL_GRACE_S = 30.0


def _active_context() -> Any:
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None:
        raise ConfigError("hora.spark.run needs an active SparkContext: create a SparkSession first "
                          "(SparkSession.builder...getOrCreate())")
    return sc


def task_slots(sc: Any) -> int:
    """How many tasks the cluster can run at once now (what a barrier stage may ask for)."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # an older Spark: its default parallelism says the same
        return int(sc.defaultParallelism)


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None, use_mpi: bool | None = None,
        use_gloo: bool | None = None, extra_mpi_args: str | None = None, env: Mapping[str, str] | None = None,
        stdout: TextIO | None = None, stderr: TextIO | None = None, verbose: int = 1,
        nics: Sequence[str] | None = None, prefix_output_with_timestamp: bool = False,
        executable: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks as one hora job; each rank's result,
    in rank order.

    ``num_proc`` defaults to the task slots of the cluster. ``env`` is added to every worker's
    environment (hora's own identity variables win). Worker output is written to ``stdout`` and
    ``stderr`` (default: this process's) prefixed ``[rank]<stdout>:``, with a timestamp when
    ``prefix_output_with_timestamp``; ``verbose=0`` keeps only warnings in the log. ``nics``:
    interface names or addresses workers listen on for their peers. ``use_mpi``/``extra_mpi_args``
    are refused (hora has no MPI controller yet); ``use_gloo`` changes nothing (hora's own transport
    is the one there is); ``executable`` is unused: Spark's Python worker runs the function (set
    ``spark.pyspark.python`` to choose it). A rank that raises makes the call raise its exception,
    with the rank and remote traceback attached.
    """
    refuse_unsupported("hora.spark.run", use_gloo=use_gloo, use_mpi=use_mpi, mpi_args=extra_mpi_args)
    if executable is not None:
        logger.warning("hora.spark.run: executable=%r is not used: Spark's own Python worker runs the "
                       "function (set spark.pyspark.python to choose that Python)", executable)
    if use_gloo:
        logger.info("hora.spark.run: use_gloo changes nothing: hora's own transport is the one there is")
    sc = _active_context()
    slots = task_slots(sc)
    if num_proc is None:
        num_proc = slots
        _log(verbose, "hora.spark.run: num_proc not given: %d, the cluster's task slots", num_proc)
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ConfigError(f"hora.spark.run: num_proc must be a positive integer, got {num_proc!r}")
    timeout = float(config.get("spark_start_timeout")) if start_timeout is None else float(start_timeout)
    if timeout <= 0:
        raise ConfigError(f"hora.spark.run: start_timeout must be positive, got {start_timeout!r}")
    payload = _pickled(fn, args, kwargs)
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    extra.update(config.env_for("start_timeout", timeout))
    if isinstance(nics, str):
        nics = nics.split(",")
    job = _SparkJob(sc, num_proc, timeout, slots, extra, stdout, stderr, prefix_output_with_timestamp, verbose,
                    tuple(str(n).strip() for n in nics or () if str(n).strip()) or None)
    return job.run(payload)


def _log(verbose: int, message: str, *values: Any) -> None:
    if verbose >= 1:
        logger.info(message, *values)


def _pickled(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bytes:
    try:
        return dumps_call(fn, args, kwargs)
    except Exception as exc:  # said before anything starts
        raise ConfigError(f"hora.spark.run: the function or its arguments cannot be sent to the tasks: "
                          f"{type(exc).__name__}: {exc}") from exc


class _SparkJob:
    """One ``run`` call: the store, the Spark job in a thread, the start bound and the results."""

    def __init__(self, sc: Any, num_proc: int, timeout: float, slots: int, extra_env: dict[str, str],
                 stdout: TextIO | None, stderr: TextIO | None, timestamps: bool, verbose: int,
                 nics: tuple[str, ...] | None = None) -> None:
        self.sc = sc
        self.nics = nics
        self.num_proc = num_proc
        self.timeout = timeout
        self.slots = slots
        self.extra_env = extra_env
        self.verbose = verbose
        self.relay = OutputRelay(stdout, stderr, timestamps)
        self.group = ""
        self._outcome: list[tuple[int, bytes]] | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def run(self, payload: bytes) -> list[Any]:
        host = self.sc.getConf().get("spark.driver.host", None) or "127.0.0.1"
        secret = new_secret()  # fresh per call: a task of another job cannot join this one
        server = RendezvousServer(secret, host=host, port=0).start()
        try:
            context = JobContext.fresh(*server.address, secret=secret)
            self.group = f"hora-{context.job_id}"
            server.store.set(FUNC_KEY, payload)
            server.store.set(SYS_PATH_KEY, json.dumps([p for p in sys.path if isinstance(p, str)]).encode())
            spec = TaskSpec(context, self.extra_env, self.timeout, ship_output=True, nics=self.nics)
            thread = threading.Thread(target=self._spark_job, args=(spec,), name="hora-spark-job", daemon=True)
            began = time.monotonic()
            thread.start()
            self._supervise(server, began)
            thread.join(timeout=_CANCEL_GRACE_S)
            self.relay.deliver(server.store)
        finally:
            self.relay.flush()
            server.stop()
        return self._results()

    def _spark_job(self, spec: TaskSpec) -> None:
        try:
            self.sc.setJobGroup(self.group, f"hora job of {self.num_proc} tasks", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.num_proc), self.num_proc)
            self._outcome = rdd.barrier().mapPartitions(lambda it: run_task(spec, it)).collect()
        except BaseException as exc:  # handed to the caller's thread
            self._error = exc
        finally:
            self._done.set()

    def _supervise(self, server: RendezvousServer, began: float) -> None:
        started_prefix = f"{KEY_PREFIX}started/"
        restarted_prefix = f"{KEY_PREFIX}restarted/"
        all_started = False
        while not self._done.wait(_POLL_S):
            self.relay.deliver(server.store)
            started = server.store.keys(started_prefix)
            if server.store.keys(restarted_prefix):
                self._cancel()
                raise LaunchError("hora.spark.run: a task of the job was lost and Spark restarted the stage; the "
                                  "job was cancelled (a hora world cannot be resumed by new tasks; "
                                  "hora.spark.run_elastic survives lost tasks)")
            if not all_started:
                if len(started) >= self.num_proc:
                    all_started = True
                    _log(self.verbose, "hora.spark.run: %d tasks started in %.1f s", self.num_proc,
                         time.monotonic() - began)
                elif time.monotonic() - began > self.timeout:
                    self._cancel()
                    raise LaunchError(
                        f"hora.spark.run: Spark started {len(started)} of {self.num_proc} tasks within "
                        f"start_timeout={self.timeout:g} s; the cluster has {task_slots(self.sc)} task slot(s) "
                        f"({self.slots} when the call began). A barrier stage needs all num_proc tasks "
                        "running at once: ask for num_proc <= the task slots, add executors, or raise "
                        "start_timeout")

    def _cancel(self) -> None:
        try:
            self.sc.cancelJobGroup(self.group)
        except Exception as exc:  # the context may be stopping
            logger.debug("cancelling the Spark job: %s", exc)
        self._done.wait(_CANCEL_GRACE_S)

    def _results(self) -> list[Any]:
        if self._error is not None:
            raise LaunchError(f"hora.spark.run: the Spark job failed: {_spark_reason(self._error)}") from self._error
        if self._outcome is None:
            raise LaunchError(f"hora.spark.run: the Spark job did not finish within {_CANCEL_GRACE_S:g} s of its "
                              "tasks ending")
        by_rank = dict(self._outcome)
        decoded = {rank: cloudpickle.loads(blob) for rank, blob in by_rank.items()}
        failed = [rank for rank in sorted(decoded) if decoded[rank][0] == "error"]
        if failed:
            rank = _first_cause(failed, decoded)
            raise_remote(rank, f"Spark task {rank}", self.num_proc, *decoded[rank][1:])
        return [decoded[rank][1] for rank in range(self.num_proc)]


def _first_cause(failed: list[int], decoded: dict[int, tuple]) -> int:
    """The failure to report: the first rank whose exception is not a peer's consequence (ranks that
    lost a failed peer raise HorovodInternalError), else the first."""
    for rank in failed:
        blob = decoded[rank][1]
        try:
            exc = cloudpickle.loads(blob) if blob is not None else None
        except Exception:  # it is reported as text then
            exc = None
        if not isinstance(exc, HorovodInternalError):
            return rank
    return failed[0]


def _spark_reason(exc: BaseException) -> str:
    """A Spark (Py4J) error's message without the JVM stack trace."""
    text = str(exc)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("at ", "py4j", "Traceback", "File ")) and "Exception" in line:
            return line.lstrip(": ")[:600]
    return text.strip().splitlines()[0][:600] if text.strip() else type(exc).__name__


class OutputRelay:
    """Writes the tasks' output (from the store) to the driver's streams, line by line, prefixed."""

    def __init__(self, stdout: TextIO | None, stderr: TextIO | None, timestamps: bool) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._timestamps = timestamps
        self._partial: dict[tuple[int, str], str] = {}

    def _stream(self, name: str) -> TextIO:
        chosen = self._streams[name]
        return chosen if chosen is not None else (sys.stdout if name == "stdout" else sys.stderr)

    def deliver(self, store: Any) -> None:
        prefix = output_prefix()
        for key in sorted(store.keys(prefix)):
            blob = store.try_get(key)
            store.delete(key)
            if blob is None:
                continue
            rank = int(key[len(prefix):].split("/", 1)[0])
            for name, text in json.loads(blob):
                self._write(rank, name, text)

    def _write(self, rank: int, name: str, text: str) -> None:
        buffered = self._partial.pop((rank, name), "") + text
        *lines, rest = buffered.split("\n")
        if rest:
            self._partial[(rank, name)] = rest
        stream = self._stream(name)
        for line in lines:
            stream.write(self._prefix(rank, name) + line + "\n")
        if lines:
            stream.flush()

    def _prefix(self, rank: int, name: str) -> str:
        stamp = datetime.now().strftime("%a %b %d %H:%M:%S %Y") + " " if self._timestamps else ""
        return f"{stamp}[{rank}]<{name}>:"

    def flush(self) -> None:
        for (rank, name), rest in sorted(self._partial.items()):
            self._stream(name).write(self._prefix(rank, name) + rest + "\n")
        self._partial.clear()
