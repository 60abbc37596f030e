"""NCCL is bounded: a dead or stuck peer ends in HorovodInternalError and ncclCommAbort, never a hang.

Real NCCL's kernel spins forever on the GPU when a peer of its collective is gone, and so would any
wait on it. These jobs run 2 real worker processes through the emulated NCCL and CUDA
(``nccl_emulation.py``), whose kernels hang the same way: an enqueued collective whose peer is gone
never finishes until ``ncclCommAbort`` is called on its communicator. The arrays come without a CUDA
stream, so hora itself must wait for the GPU before it hands a result back: the wait the old code
made in ``cudaEventSynchronize``, forever.

- a rank SIGKILLed inside an NCCL allreduce: the survivor raises HorovodInternalError naming the
  dead rank, its own rank and host, well within the bound, and has aborted its communicators;
- a rank whose GPU never runs the collective (the other waits on it): both raise once the stall
  shutdown time has passed, both abort; then ``shutdown()``/``init()`` (an elastic reset) forms new
  communicators, and an allreduce on them works;
- in one process: hora's own waits on the GPU end; a reset after an abort makes fresh communicators
  under a new epoch; NCCL's asynchronous error report fails pending work at once.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import numpy as np
import pytest
from job_env import clean_env
from nccl_fakes import CallLog, RecordingCuda, RecordingNccl

import hora
from hora.errors import HorovodInternalError, WorkerFailedError
from hora.nccl.communicators import CommunicatorTable
from hora.nccl.ops import DeviceCollectives

pytestmark = pytest.mark.timeout(60)

#: What "bounded" means here: generous next to the detection (about a cycle, or the stall time).
BOUND_S = 30.0
STALL_S = 3.0
VICTIM = 1


def _values(rank: int, salt: int = 0) -> np.ndarray:
    return (np.arange(6, dtype=np.float32) + 10 * rank + salt)


def _emulated() -> tuple[Any, Any, Any]:
    """Install the emulation in this worker; returns (cuda, nccl, HostCudaArray)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import nccl_emulation

    cuda, nccl = nccl_emulation.install()
    return cuda, nccl, nccl_emulation.HostCudaArray


def _error(exc: BaseException, started: float) -> dict[str, Any]:
    return {"type": type(exc).__name__, "internal": isinstance(exc, HorovodInternalError), "message": str(exc),
            "after_s": time.monotonic() - started, "at": time.time()}


# ---- a rank killed with SIGKILL inside an NCCL allreduce ----------------------------------------


def _kill_job(tmpdir: str, mode: str) -> None:
    """``mode`` "handle": the survivor waits on its allreduce's handle (no stream: hora waits for the
    GPU). "stream": its framework has a stream, so hora hands the result back at enqueue and the
    framework's own GPU sync is what would hang; the next hora call raises."""
    import signal

    from hora import collectives, device_requests as submit
    from hora.engine.request import Kind

    cuda, nccl, HostCudaArray = _emulated()
    hora.init()
    r = hora.rank()
    path = os.path.join(tmpdir, f"rank{r}.json")
    if r != VICTIM:  # the launcher stops the job (SIGTERM) once the victim dies; report first
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record: dict[str, Any] = {"rank": r, "host": socket.gethostname()}
    record["warmup"] = hora.allreduce(HostCudaArray(_values(r)), op=hora.Sum, name="warmup").host.tolist()
    if r == VICTIM:
        with open(path, "w") as handle:
            json.dump({"rank": r, "dies_at": time.time()}, handle)
        nccl.fault = "die"  # its next NCCL kernel kills this process as the GPU starts it
    started = time.monotonic()
    try:
        if mode == "handle":
            hora.allreduce(HostCudaArray(_values(r, 1)), op=hora.Sum, name="doomed")
        else:
            stream = cuda.stream_create()  # the framework's stream
            request = submit.cuda_request(Kind.ALLREDUCE, HostCudaArray(_values(r, 1)), "doomed",
                                          hora.global_process_set, op=hora.Sum, inplace=True, stream=stream)
            assert request is not None
            collectives.submit_requests([request])[0].wait()  # enqueued: handed back at once
            synced = cuda.event_create()
            cuda.event_record(synced, stream)
            try:  # the framework's GPU sync: ends once hora has aborted the spinning kernel
                cuda.event_synchronize(synced)
                record["gpu_sync"] = "returned"
            except Exception as exc:
                record["gpu_sync"] = f"{type(exc).__name__}: {exc}"
            hora.allreduce(HostCudaArray(_values(r, 2)), op=hora.Sum, name="next")
        record["error"] = None
    except Exception as exc:  # reported to the test
        record["error"] = _error(exc, started)
        try:  # the engine stays failed: the next call fails at once
            hora.allreduce(HostCudaArray(_values(r, 2)), op=hora.Sum, name="after")
            record["after"] = None
        except Exception as again:
            record["after"] = _error(again, started)
    hora.shutdown()  # the engine thread is done with its abort too
    record["calls"] = list(nccl.calls)
    record["stuck"] = [names for names, _ in nccl.stuck]
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)


@pytest.mark.parametrize("mode", ["handle", "stream"])
def test_a_rank_killed_inside_an_nccl_allreduce_fails_the_survivor_in_bounded_time_and_aborts_nccl(tmp_path, mode):
    with pytest.raises(WorkerFailedError) as failure:
        hora.run(_kill_job, args=(str(tmp_path), mode), np=2, env=clean_env(), kill_grace=BOUND_S,
                 start_timeout=60)
    assert failure.value.rank == VICTIM
    dies_at = json.loads((tmp_path / f"rank{VICTIM}.json").read_text())["dies_at"]
    survivor = tmp_path / "rank0.json"
    assert survivor.exists(), "the survivor never reported: it hung on the NCCL allreduce until it was killed"
    record = json.loads(survivor.read_text())
    assert record["warmup"] == (_values(0) + _values(1)).tolist()
    error = record["error"]
    assert error is not None and error["internal"], record
    assert error["at"] - dies_at < BOUND_S, record
    message = error["message"]
    assert "rank 0" in message and "rank 1" in message and record["host"] in message, message
    assert "ncclCommAbort" in message, message
    assert record["stuck"] == [["all_reduce"]], record  # its kernel met the dead peer and spun...
    assert record["calls"][-1] == "abort" and record["calls"].count("abort") == 1, record  # ...until aborted
    assert record["after"] is not None and record["after"]["internal"], record
    if mode == "stream":  # the framework's GPU sync ended: the abort ended the kernel it waited for
        assert record["gpu_sync"] == "returned", record


# ---- a stalled collective, then an elastic-style reset ------------------------------------------


def _stall_job() -> dict[str, Any]:
    _, nccl, HostCudaArray = _emulated()
    hora.init()
    r = hora.rank()
    out: dict[str, Any] = {"host": socket.gethostname()}
    out["warmup"] = hora.allreduce(HostCudaArray(_values(r)), op=hora.Sum, name="warmup").host.tolist()
    if r == VICTIM:
        nccl.fault = "hang"  # its GPU never runs the next collective: rank 0's kernel waits on it
    started = time.monotonic()
    try:
        hora.allreduce(HostCudaArray(_values(r, 1)), op=hora.Sum, name="stalled")
        out["error"] = None
    except Exception as exc:
        out["error"] = _error(exc, started)
    # what elastic training does on HorovodInternalError: a new world, new communicators
    hora.shutdown()
    out["calls_after_abort"] = list(nccl.calls)
    hora.init()
    if r == 0:  # rank 1 gets its result first and shuts down while rank 0's GPU still works on it
        nccl.kernel_delay = 0.5
    out["after_reset"] = hora.allreduce(HostCudaArray(_values(r, 3)), op=hora.Sum, name="fresh").host.tolist()
    out["calls"] = list(nccl.calls)
    hora.shutdown()
    out["calls_after_shutdown"] = list(nccl.calls)
    return out


@pytest.fixture(scope="module")
def stalled() -> list[dict[str, Any]]:
    env = clean_env({"HORA_STALL_SHUTDOWN_TIME_SECONDS": str(STALL_S)})
    return hora.run(_stall_job, np=2, env=env, kill_grace=5, start_timeout=60)


def test_a_collective_stalled_past_the_stall_shutdown_time_aborts_nccl_on_every_rank(stalled):
    for rank, out in enumerate(stalled):
        assert out["warmup"] == (_values(0) + _values(1)).tolist()
        error = out["error"]
        assert error is not None and error["internal"], out
        assert STALL_S - 0.5 <= error["after_s"] < BOUND_S, out
        message = error["message"]
        assert f"rank {rank}" in message and out["host"] in message and "ncclCommAbort" in message, message
        assert "HORA_STALL_SHUTDOWN_TIME_SECONDS" in message, message  # the cause, on the rank that saw it or its peer
        assert out["calls_after_abort"] == [f"init:{rank}/2", "all_reduce", "all_reduce", "abort"], out


def test_after_an_abort_a_reset_makes_fresh_communicators_and_allreduce_works(stalled):
    for rank, out in enumerate(stalled):
        assert out["after_reset"] == (_values(0, 3) + _values(1, 3)).tolist()
        assert out["calls"] == out["calls_after_abort"] + [f"init:{rank}/2", "all_reduce"], out
        assert out["calls_after_shutdown"] == out["calls"] + ["destroy"], out  # the fresh one ends normally


# ---- in one process ---------------------------------------------------------------------------


class _NeverDone(RecordingCuda):
    """A GPU whose work never finishes (an NCCL kernel whose peer is gone)."""

    def event_query(self, event):
        self.log.append(("event_query", event))
        return False

    def event_synchronize(self, event):
        raise AssertionError("hora blocked in cudaEventSynchronize on work that never finishes")


def test_hora_waits_on_the_gpu_end_at_the_stall_limit_or_at_once_after_an_abort():
    log = CallLog()
    ops = DeviceCollectives(_NeverDone(log), RecordingNccl(log), stall_limit=0.3, who="rank 5 on host-x")
    started = time.monotonic()
    with pytest.raises(HorovodInternalError, match=r"rank 5 on host-x: waiting for hora's CUDA stream.*within 0.3 s"):
        ops.drain()
    assert 0.3 <= time.monotonic() - started < 5
    ops.failure = "rank 2 closed its connection"
    started = time.monotonic()
    with pytest.raises(HorovodInternalError, match="aborted.*rank 2 closed its connection"):
        ops.drain()
    assert time.monotonic() - started < 0.3


class _Backend:
    """NCCL's communicator calls, recorded; an asynchronous error can be set per communicator."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.errors: dict[int, int] = {}
        self._handles = iter(range(1, 100))

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        handle = next(self._handles)
        self.calls.append(("init", handle, unique_id))
        return handle

    def comm_destroy(self, comm: int) -> None:
        self.calls.append(("destroy", comm))

    def comm_abort(self, comm: int) -> None:
        self.calls.append(("abort", comm))

    def comm_get_async_error(self, comm: int) -> int:
        return self.errors.get(comm, 0)

    def error_string(self, code: int) -> str:
        return "remote process exited or there was a network error"


@pytest.fixture
def store():
    from hora.rendezvous.auth import new_secret
    from hora.rendezvous.client import RendezvousClient
    from hora.rendezvous.server import RendezvousServer

    secret = new_secret()
    with RendezvousServer(secret) as server, RendezvousClient(*server.address, secret) as client:
        yield client


def test_a_reset_after_an_abort_makes_fresh_communicators_under_a_new_epoch(store):
    backend = _Backend()
    table = CommunicatorTable(backend, store, "round3", timeout=5)
    first = table.get(0, [0, 1], 0)
    table.abort()
    assert len(table) == 0 and backend.calls[-1] == ("abort", first.comm)
    second = table.get(0, [0, 1], 0)
    assert second.epoch == first.epoch + 1 and second.comm != first.comm
    published = [store.get(table.key_for(0, epoch), 1) for epoch in (0, 1)]
    assert published == [backend.calls[0][2], backend.calls[-1][2]] and published[0] != published[1]


def test_ncclcommgetasyncerror_fails_pending_work_at_once_naming_the_error(store):
    from hora.engine.coordinator import Response
    from hora.engine.executor import Item
    from hora.engine.request import Handle, Kind, Request, signature
    from hora.nccl.device_tensor import DL_CUDA, DeviceBuffer
    from hora.nccl.dispatch import DeviceExecutor, DeviceTensor

    class Pending(RecordingCuda):
        def event_query(self, event):
            return False

    backend = _Backend()
    log = CallLog()
    ops = DeviceCollectives(Pending(log), RecordingNccl(log), stall_limit=60, who="rank 0 on host-y")
    executor = DeviceExecutor(ops, CommunicatorTable(backend, store, "round0", timeout=5), 0, [0], 0)
    sig = signature(Kind.ALLREDUCE, "float32", (4,))
    buffer = DeviceBuffer(0x1000, DL_CUDA, 0, np.dtype(np.float32), (4,), True, 7)
    item = Item(Response("t", sig), Request("t", sig, DeviceTensor("t", buffer, 7, None), Handle("t")))
    completed: list[Any] = []
    executor.run([item], lambda done, result: completed.append(done))
    assert completed == [item]  # on a stream: handed back at once, watched until the GPU is done
    assert executor.poll(completed.append) == 0  # pending, healthy
    backend.errors[1] = 6  # ncclRemoteError
    with pytest.raises(HorovodInternalError, match=r"rank 0 on host-y: NCCL reports .*remote process exited.*'t'"):
        executor.poll(completed.append)
