"""NCCL on a real GPU: what one GPU allows (a one-rank communicator, every collective, the stream ordering).

These run only where CUDA sees a GPU and libnccl and torch's CUDA build are installed; elsewhere
they skip and say which of those is missing. Two ranks on one GPU are not tried here: NCCL refuses
two ranks of one communicator on the same device ("Duplicate GPU detected").
"""

from __future__ import annotations

import pytest
from nccl_gpu import needs_gpu

from hora.nccl import cudart, library
from hora.nccl.communicators import DeviceComm
from hora.nccl.device_tensor import describe
from hora.nccl.ops import DeviceCollectives
from hora.transport.base import ReduceOp

pytestmark = pytest.mark.timeout(120)


pytestmark = [pytestmark, needs_gpu]


@pytest.fixture(scope="module")
def one_rank():
    import torch

    torch.cuda.set_device(0)
    nccl = library.Nccl()
    handle = nccl.comm_init_rank(1, nccl.unique_id(), 0)
    ops = DeviceCollectives(cudart.CudaRuntime(), nccl, fusion_threshold=1 << 20)
    yield torch, ops, DeviceComm("global", handle, 0, 1, 0)
    ops.close()
    nccl.comm_destroy(handle)


def _run(torch, ops, body):
    stream = torch.cuda.current_stream().cuda_stream
    ops.run(stream, stream, body)


def test_allreduce_with_scales_and_fusion_on_one_gpu(one_rank):
    torch, ops, comm = one_rank
    tensors = [torch.full((n,), 2.0, device="cuda") for n in (3, 100, 1 << 19)]
    bufs = [describe(t) for t in tensors]
    _run(torch, ops, lambda: ops.allreduce(comm, bufs, ReduceOp.AVERAGE, prescale=3.0, postscale=0.5))
    for t in tensors:  # read on the framework's stream, which waits on hora's done event
        assert torch.allclose(t, torch.full_like(t, 3.0))


def test_data_movement_on_one_gpu(one_rank):
    torch, ops, comm = one_rank
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    out = torch.empty(6, device="cuda")
    _run(torch, ops, lambda: ops.allgather(comm, describe(x), describe(out), [6]))
    assert torch.equal(out, x)
    _run(torch, ops, lambda: ops.broadcast(comm, describe(x), 0))
    out2 = torch.empty(6, device="cuda")
    _run(torch, ops, lambda: ops.alltoall(comm, describe(x), [6], describe(out2), [6]))
    assert torch.equal(out2, x)
    rs = torch.empty(6, device="cuda")
    _run(torch, ops, lambda: ops.reducescatter(comm, describe(x), describe(rs), [6], ReduceOp.SUM))
    assert torch.equal(rs, x)


def _torch_engine_job() -> dict:
    import torch

    import hora.torch as hvd
    from hora import basics

    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    out = {"sum": hvd.allreduce(x, op=hvd.Sum).cpu().tolist(), "avg_inplace": hvd.allreduce_(x.clone()).cpu().tolist()}
    out["on_cuda"] = hvd.allreduce(x).is_cuda
    out["gathered"] = hvd.allgather(x.reshape(4, 2)).shape[0]
    out["device_path_used"] = basics.engine().device_context.started
    out["host_and_device"] = hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


def test_hora_torch_cuda_tensors_take_nccl_through_the_engine():
    from job_env import clean_env

    import hora

    size = 1  # one GPU: NCCL refuses two ranks of one communicator on the same device
    [out] = hora.run(_torch_engine_job, np=size, env=clean_env(), start_timeout=120)
    assert out["device_path_used"] and out["on_cuda"]
    assert out["sum"] == [float(i) * size for i in range(8)]
    assert out["avg_inplace"] == [float(i) for i in range(8)]
    assert out["gathered"] == 4 * size
    assert out["host_and_device"] == [float(size)] * 3


def test_two_ranks_on_one_gpu_through_host_memory():
    """Two ranks cannot share one GPU in a NCCL communicator, so HORA_NCCL=off takes the host path."""
    from job_env import clean_env

    import hora

    results = hora.run(_torch_engine_job, np=2, env=clean_env({"HORA_NCCL": "off"}), start_timeout=120)
    for out in results:
        assert not out["device_path_used"] and out["on_cuda"]
        assert out["sum"] == [float(i) * 2 for i in range(8)]
        assert out["gathered"] == 8
