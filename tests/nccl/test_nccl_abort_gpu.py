"""NCCL is bounded, on a real GPU: what one GPU can show of it.

``cudaEventQuery`` through hora's binding says "not yet" while a kernel runs; hora's own wait on the
GPU ends at the stall limit (and at once once the device side is aborted) instead of blocking in
``cudaEventSynchronize``; ``ncclCommAbort`` ends a communicator, and the set's next one is fresh, under
a new epoch, and works. A dead peer's kernel cannot be made on one GPU (NCCL refuses two ranks of a
communicator on one device): ``test_nccl_abort.py`` checks that through the emulation. These skip,
saying why, where CUDA, libnccl or torch's CUDA build is missing.
"""

from __future__ import annotations

import time

import pytest
from nccl_gpu import needs_gpu

from hora.errors import HorovodInternalError
from hora.nccl import cudart, library
from hora.nccl.communicators import CommunicatorTable
from hora.nccl.device_tensor import describe
from hora.nccl.ops import DeviceCollectives
from hora.transport.base import ReduceOp

pytestmark = pytest.mark.timeout(60)


pytestmark = [pytestmark, needs_gpu]


@pytest.fixture
def torch_and_ops():
    import torch

    torch.cuda.set_device(0)
    ops = DeviceCollectives(cudart.CudaRuntime(), library.Nccl(), fusion_threshold=1 << 20, stall_limit=0.5,
                            who="rank 0 on the GPU machine")
    yield torch, ops
    torch.cuda.synchronize()


def _busy(torch, ops, seconds: float) -> None:
    """A kernel on hora's stream that runs about ``seconds`` (as a collective waiting for a peer would)."""
    props = torch.cuda.get_device_properties(0)
    rate = getattr(props, "clock_rate", 0) * 1000 or 2_000_000_000  # kHz; a guess where torch hides it
    with torch.cuda.stream(torch.cuda.ExternalStream(ops.stream)):
        torch.cuda._sleep(int(seconds * rate))


def test_event_query_and_hora_wait_on_the_gpu_end_at_the_stall_limit(torch_and_ops):
    torch, ops = torch_and_ops
    _busy(torch, ops, 3.0)
    event = ops.before(None)
    assert ops.cuda.event_query(event) is False  # cudaErrorNotReady is "not yet", not an error
    started = time.monotonic()
    with pytest.raises(HorovodInternalError, match="did not finish its work within 0.5 s"):
        ops.wait(event, "waiting in the test")
    assert 0.5 <= time.monotonic() - started < 2.0
    ops.failure = "a peer died"
    started = time.monotonic()
    with pytest.raises(HorovodInternalError, match="aborted .a peer died"):
        ops.wait(event, "waiting in the test")
    assert time.monotonic() - started < 0.2
    ops.failure = None
    torch.cuda.synchronize()
    assert ops.cuda.event_query(event) is True
    ops.wait(ops.before(None), "waiting on an idle stream")  # done: returns at once


def test_ncclcommabort_ends_a_communicator_and_the_next_one_is_fresh_and_works(torch_and_ops):
    from hora.rendezvous.auth import new_secret
    from hora.rendezvous.client import RendezvousClient
    from hora.rendezvous.server import RendezvousServer

    torch, ops = torch_and_ops
    secret = new_secret()
    with RendezvousServer(secret) as server, RendezvousClient(*server.address, secret) as store:
        table = CommunicatorTable(ops.nccl, store, "gpu", timeout=10)
        results = []
        for _ in range(2):
            comm = table.get(0, [0], 0)
            x = torch.full((1000,), 2.0, device="cuda")
            stream = torch.cuda.current_stream().cuda_stream
            ops.run(stream, stream, lambda c=comm, t=x: ops.allreduce(c, [describe(t)], ReduceOp.SUM, prescale=3.0))
            results.append((comm.epoch, float(x[0])))
            table.abort()  # ncclCommAbort, as after a peer's failure
        assert results == [(0, 6.0), (1, 6.0)] and len(table) == 0
