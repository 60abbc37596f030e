"""One hora worker inside a Spark barrier task: where ``hora.spark.run``'s function actually runs.

Every task of the barrier stage sees the same list of task addresses (``BarrierTaskContext
.getTaskInfos()``), so each computes the same layout on its own: tasks grouped by executor host (in
the order hosts first appear), ranks host by host (:func:`hora.workers.hosts.assign_slots`), local
ranks in partition order within a host. A task then takes its rank's environment (the same
variables ``hora run`` gives a worker process), reports itself started to the driver's rendezvous
store, runs the function and returns its encoded outcome as the partition's one element.

PySpark reuses its Python worker processes from task to task, so a task leaves the process as it
found it: hora shut down, the environment, ``sys.stdout``/``sys.stderr`` and ``sys.path`` restored.
While the function runs, what it prints goes to the driver (through the store), where
``hora.spark.run`` writes it with a ``[rank]<stdout>:`` prefix, as ``hora run`` does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle

from hora import config
from hora.rendezvous import RendezvousClient
from hora.runner.launching.worker_env import JobContext, worker_environment
from hora.runner.task import encode_error, encode_success
from hora.workers.hosts import Host, SlotInfo, assign_slots
from hora.workers.remote_bootstrap import resolve_listen_address

KEY_PREFIX = "spark/"
FUNC_KEY = KEY_PREFIX + "func"
SYS_PATH_KEY = KEY_PREFIX + "sys_path"
_SHIP_INTERVAL_S = 0.2


def started_key(partition: int) -> str:
    return f"{KEY_PREFIX}started/{partition:06d}"


def restarted_key(partition: int) -> str:
    return f"{KEY_PREFIX}restarted/{partition:06d}"


def output_prefix() -> str:
    return f"{KEY_PREFIX}out/"


def output_key(rank: int, sequence: int) -> str:
    return f"{output_prefix()}{rank:06d}/{sequence:09d}"


def layout(hosts: list[str]) -> list[SlotInfo]:
    """Each partition's slot, given each partition's executor address (``host:port``; list index =
    partition): executors on one machine are one host."""
    order: dict[str, list[int]] = {}  # by machine: executors of one machine share memory
    for partition, address in enumerate(hosts):
        order.setdefault(_host_label(address), []).append(partition)
    slots = assign_slots([Host(host, len(parts)) for host, parts in order.items()], len(hosts))
    by_partition: list[SlotInfo | None] = [None] * len(hosts)
    for slot, partition in zip(slots, [p for parts in order.values() for p in parts]):
        by_partition[partition] = slot
    return [slot for slot in by_partition if slot is not None]


def _host_label(address: str) -> str:
    """An executor address (``host:port``) as a host name: the host part."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "localhost"


@dataclass(frozen=True)
class TaskSpec:
    """What the driver sends every task (inside the mapPartitions closure)."""

    context: JobContext
    extra_env: dict[str, str]
    start_timeout: float
    ship_output: bool
    nics: tuple[str, ...] | None = None  # interfaces (or addresses) to listen on: the first present here


class ToDriver(io.TextIOBase):
    """A task's ``sys.stdout``/``sys.stderr`` while the function runs: the text goes to the driver,
    as a worker process's output goes to ``hora run`` (not also to the executor's own log, which in
    local mode is the driver's terminal too)."""

    def __init__(self, name: str, shipper: OutputShipper) -> None:
        self._name = name
        self._shipper = shipper

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._shipper.add(self._name, text)
        return len(text)


class OutputShipper:
    """Collects a task's output and puts it in the store every ``_SHIP_INTERVAL_S`` (and at the end)."""

    def __init__(self, client: RendezvousClient, rank: int) -> None:
        self._client = client
        self._rank = rank
        self._lock = threading.Lock()
        self._pending: list[tuple[str, str]] = []
        self._sequence = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hora-spark-output", daemon=True)
        self._thread.start()

    def add(self, stream: str, text: str) -> None:
        with self._lock:
            self._pending.append((stream, text))

    def _loop(self) -> None:
        while not self._stop.wait(_SHIP_INTERVAL_S):
            self.ship()

    def ship(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            if not pending:
                return
            sequence, self._sequence = self._sequence, self._sequence + 1
        try:
            self._client.set(output_key(self._rank, sequence), json.dumps(pending).encode())
        except Exception:  # output is best effort; the result still travels by Spark
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.ship()


@contextlib.contextmanager
def shipped_output(client: RendezvousClient, label: int) -> Iterator[None]:
    """While the block runs, ``sys.stdout``/``sys.stderr`` go to the driver under ``label``."""
    saved = sys.stdout, sys.stderr
    shipper = OutputShipper(client, label)
    sys.stdout = ToDriver("stdout", shipper)
    sys.stderr = ToDriver("stderr", shipper)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        shipper.close()


def run_task(spec: TaskSpec, _partition: Iterator[Any]) -> Iterator[tuple[int, bytes]]:
    """The barrier stage's partition function: ``(rank, encoded outcome)``."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    partition = context.partitionId()
    hosts = [info.address for info in context.getTaskInfos()]
    slot = layout(hosts)[partition]
    job = spec.context
    with RendezvousClient(job.rendezvous_addr, job.rendezvous_port, job.secret,
                          connect_timeout=spec.start_timeout) as client:
        if client.add(f"{KEY_PREFIX}attempts/{partition:06d}") > 1:
            # Spark retries a barrier stage after a lost task by restarting every task: the job's
            # world is gone by then, and the driver stops the job when it sees this.
            client.set(restarted_key(partition), slot.hostname.encode())
            raise RuntimeError("hora.spark.run: a task of this job was lost and Spark retried the stage; "
                               "a hora job is not restarted (use hora.spark.run_elastic to survive lost tasks)")
        client.set(started_key(partition), slot.hostname.encode())
        outcome = _run_function(client, spec, slot)
    yield slot.rank, outcome


def _run_function(client: RendezvousClient, spec: TaskSpec, slot: SlotInfo) -> bytes:
    saved_env = dict(os.environ)
    saved_path = list(sys.path)
    output = shipped_output(client, slot.rank) if spec.ship_output else contextlib.nullcontext()
    try:
        try:
            for entry in json.loads(client.get(SYS_PATH_KEY, timeout=spec.start_timeout)):
                if entry not in sys.path:
                    sys.path.append(entry)
            env = worker_environment(slot, spec.context, base={}, extra=spec.extra_env)
            if spec.nics:
                try:
                    address = resolve_listen_address(list(spec.nics))
                except LookupError as exc:
                    raise RuntimeError(f"nics={list(spec.nics)} on {slot.hostname}: {exc}") from None
                env.update(config.env_for("iface", address, with_alias=False))
            os.environ.update(env)
            fn, args, kwargs = cloudpickle.loads(client.get(FUNC_KEY, timeout=spec.start_timeout))
            with output:
                value = fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit included: it must not end Spark's worker
            return encode_error(exc, traceback.format_exc())
        try:
            return encode_success(value)
        except Exception as exc:
            return encode_error(TypeError(f"rank {slot.rank}: the function returned a {type(value).__name__} "
                                          f"that cannot be pickled ({exc}); return something picklable"),
                                traceback.format_exc())
    finally:
        forget_hora()
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path


def forget_hora() -> None:
    """Shut hora down and forget this job: Spark may hand the process a task of another job next."""
    basics = sys.modules.get("hora.basics")
    if basics is not None:
        try:
            basics.reset()
        except Exception:  # the process is reused by Spark: never fail here
            pass
