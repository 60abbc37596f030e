"""The task side of ``hora.spark.run_elastic``: a Spark task that serves as one worker slot.

A barrier stage cannot outlive a lost executor, so an elastic Spark job runs differently: the driver
starts one ordinary (non-barrier) Spark job of ``max_np`` tasks, and each task, an *agent*, is a
slot of its executor (:func:`executor_name`). An agent registers in the job's rendezvous store, beats a heartbeat
every ``HEARTBEAT_S``, and waits for the driver to hand it a worker to run: the elastic driver's
environment for that slot, under which it calls the job's function (``hvd.init()`` joins the
driver's current rendezvous round). It posts the outcome, then waits for the next worker (a worker
whose slot left the world ends with ``SystemExit(0)`` and its agent can take a slot again later).

When an executor is lost, its agents' heartbeats stop: the driver counts their workers as lost and
the world re-forms without them. Spark runs a failed task again (``spark.task.maxFailures``) on an
executor that has room, and the new attempt registers as a new agent, so the job grows back. All
agents stop when the driver writes the end key, or when the driver's store goes away.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import cloudpickle

from hora import config
from hora.rendezvous import RendezvousClient
from hora.runner.launching.worker_env import JobContext
from hora.runner.task import encode_error, encode_success
from hora.spark.task import forget_hora, shipped_output
from hora.workers.remote_bootstrap import resolve_listen_address

PREFIX = "spark-elastic/"
FUNC_KEY = PREFIX + "func"
SYS_PATH_KEY = PREFIX + "sys_path"
END_KEY = PREFIX + "end"
HEARTBEAT_S = 0.5
_WAIT_S = 0.1


def agent_key(agent: str) -> str:
    """Where an agent registers: its host and process."""
    return f"{PREFIX}agents/{agent}"


def heartbeat_key(agent: str) -> str:
    return f"{PREFIX}heartbeat/{agent}"


def command_key(agent: str, number: int) -> str:
    """The environment of worker ``number`` the driver hands to ``agent``."""
    return f"{PREFIX}command/{agent}/{number:06d}"


def outcome_key(agent: str, number: int) -> str:
    return f"{PREFIX}outcome/{agent}/{number:06d}"


def executor_name() -> str:
    """The name this agent's executor goes by in the job: its machine and the process that serves
    the executor's Python workers. Each executor is a host to the elastic driver, so a lost executor
    is left out alone (not the other executors of its machine), and its replacement is a new host.
    Ranks on one machine still share memory: the transport asks the kernel who shares a machine."""
    return f"{socket.gethostname()}-{os.getppid()}"


def serve(context: JobContext, nics: tuple[str, ...] | None, _partition: Iterator[Any]) -> Iterator[str]:
    """The agent task: register, beat, run the workers handed over, until the job ends."""
    from pyspark import TaskContext

    task = TaskContext.get()
    agent = f"{task.partitionId():04d}-{task.attemptNumber()}-{uuid.uuid4().hex[:8]}"
    timeout = float(config.get("start_timeout"))
    with RendezvousClient(context.rendezvous_addr, context.rendezvous_port, context.secret,
                          connect_timeout=timeout) as client:
        stop = threading.Event()
        beat = threading.Thread(target=_beat, args=(context, agent, stop), name="hora-agent-heartbeat", daemon=True)
        client.set(agent_key(agent), json.dumps({"host": executor_name(), "pid": os.getpid()}).encode())
        beat.start()
        try:
            number = 0
            while client.try_get(END_KEY) is None:
                pending = sorted(client.keys(f"{PREFIX}command/{agent}/"))
                if not pending:
                    time.sleep(_WAIT_S)
                    continue
                key = pending[0]
                number = int(key.rsplit("/", 1)[1])
                env = json.loads(client.get(key, timeout=timeout))
                client.delete(key)
                client.set(outcome_key(agent, number), _run_worker(client, number, env, nics, timeout))
        finally:
            stop.set()
            beat.join(timeout=2)
    yield agent


def _beat(context: JobContext, agent: str, stop: threading.Event) -> None:
    """Heartbeats on a connection of their own, so a long ``get`` of the agent never delays one."""
    try:
        with RendezvousClient(context.rendezvous_addr, context.rendezvous_port, context.secret) as client:
            while not stop.is_set():
                client.set(heartbeat_key(agent), str(time.time()).encode())
                stop.wait(HEARTBEAT_S)
    except Exception:  # the driver is gone: the agent's loop ends on its own
        return


def _run_worker(client: RendezvousClient, number: int, env: dict[str, str], nics: tuple[str, ...] | None,
                timeout: float) -> bytes:
    """One worker: the function under the slot's environment; the encoded outcome with the rank it
    ended with (elastic jobs re-rank their workers) or ``left`` when its slot left the world."""
    saved_env = dict(os.environ)
    saved_path = list(sys.path)
    try:
        for entry in json.loads(client.get(SYS_PATH_KEY, timeout=timeout)):
            if entry not in sys.path:
                sys.path.append(entry)
        if nics:
            try:
                env = {**env, **config.env_for("iface", resolve_listen_address(list(nics)), with_alias=False)}
            except LookupError as exc:
                return _encoded(encode_error(RuntimeError(f"nics={list(nics)} on {socket.gethostname()}: {exc}"), ""))
        os.environ.update(env)
        fn, args, kwargs = cloudpickle.loads(client.get(FUNC_KEY, timeout=timeout))
        try:
            with shipped_output(client, number):
                value = fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code in (0, None):
                return _encoded(None, left=True)
            return _encoded(encode_error(exc, traceback.format_exc()))
        except BaseException as exc:  # reported to the driver, never fatal to Spark's worker
            return _encoded(encode_error(exc, traceback.format_exc()))
        try:
            return _encoded(encode_success(value))
        except Exception as exc:
            return _encoded(encode_error(TypeError(f"the function returned a {type(value).__name__} that cannot "
                                                   f"be pickled ({exc})"), traceback.format_exc()))
    finally:
        forget_hora()  # the agent may run another worker, in another world
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path


def _encoded(outcome: bytes | None, left: bool = False) -> bytes:
    basics = sys.modules.get("hora.basics")
    rank = getattr(getattr(basics, "_ctx", None), "last_rank", None)
    return cloudpickle.dumps({"rank": rank, "left": left, "outcome": outcome})
