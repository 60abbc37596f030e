"""hora.torch on CUDA tensors (2 ranks sharing the GPUs there are): every collective returns a
tensor on the input's device with the right values, in-place forms write into the CUDA tensor, and
DistributedOptimizer trains a CUDA model to the same weights as one process on the whole batch.

With a GPU per rank, CUDA tensors take NCCL (hora.nccl); on a one-GPU machine the two ranks share
it, which NCCL refuses, so the job sets HORA_NCCL=off and checks the host-memory path instead. They
need a GPU and skip without one (CI has none; the engine's device path runs on CPU in
tests/nccl/test_nccl_engine_path.py through an emulation, and the host paths in this folder).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sections import JobResults, run_job  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (hora.torch's CUDA path)"),
]

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(model, optimizer, x, y) -> list[list[float]]:
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().cpu().flatten().tolist() for p in model.parameters()]


def _sections() -> list[tuple[str, Any]]:
    import hora.torch as hvd

    r, n = hvd.rank(), hvd.size()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)

    def on_device(t) -> bool:
        return t.device == device

    def allreduce():
        x = torch.arange(6, dtype=torch.float32, device=device) * (r + 1)
        out = hvd.allreduce(x, op=hvd.Sum, name="cuda.ar")
        inplace = x.clone()
        same = hvd.allreduce_(inplace, op=hvd.Average, name="cuda.ar_")
        half = hvd.allreduce(x.half(), op=hvd.Sum, name="cuda.ar16")
        bf = hvd.allreduce(x.bfloat16(), op=hvd.Max, name="cuda.arbf16")
        grouped = hvd.grouped_allreduce([x, x[:2] * 0 + r], op=hvd.Sum, name="cuda.grouped")
        return {
            "devices": [on_device(t) for t in (out, inplace, half, bf, *grouped)],
            "inplace_is_input": same is inplace,
            "sum": out.cpu().tolist(), "avg": inplace.cpu().tolist(), "half": half.float().cpu().tolist(),
            "bf16_max": bf.float().cpu().tolist(), "grouped": [g.cpu().tolist() for g in grouped],
        }

    def others():
        x = torch.full((r + 1, 2), float(r), device=device)
        gathered = hvd.allgather(x, name="cuda.ag")
        b = torch.full((3,), float(r), device=device)
        bcast = hvd.broadcast(b, root_rank=1, name="cuda.bc")
        b2 = b.clone()
        hvd.broadcast_(b2, root_rank=0, name="cuda.bc_")
        a2a, splits = hvd.alltoall(torch.arange(4, device=device, dtype=torch.int64) + 10 * r,
                                   splits=torch.tensor([1, 3]), name="cuda.a2a")
        rs = hvd.reducescatter(torch.ones(4, 2, device=device) * (r + 1), op=hvd.Sum, name="cuda.rs")
        return {
            "devices": [on_device(t) for t in (gathered, bcast, b2, a2a, rs)],
            "gathered": gathered.cpu().tolist(), "bcast": bcast.cpu().tolist(), "bcast_": b2.cpu().tolist(),
            "a2a": a2a.cpu().tolist(), "splits": splits.tolist(), "rs": rs.cpu().tolist(),
        }

    def autograd():
        x = torch.ones(3, device=device, requires_grad=True)
        y = hvd.allreduce(x * (r + 1), op=hvd.Sum, name="cuda.grad")
        y.sum().backward()
        z = torch.ones(r + 1, 2, device=device, requires_grad=True)
        (hvd.allgather(z, name="cuda.ag.grad") * 3).sum().backward()
        return {"grad": x.grad.cpu().tolist(), "device": on_device(x.grad),
                "ag_grad": z.grad.cpu().tolist(), "ag_device": on_device(z.grad)}

    def optimizer_state():
        model = _model().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
        if r == 0:  # only the root has taken a step: the others' state does not exist yet
            model(torch.ones(2, 6, device=device)).sum().backward()
            opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = [opt.state[p] for p in model.parameters()]
        return {"lr": opt.param_groups[0]["lr"],
                "exp_avg": [s["exp_avg"].cpu().flatten().tolist() for s in state],
                "devices": [on_device(s["exp_avg"]) for s in state]}

    def optimizer():
        x, y = _batch()
        half = x.shape[0] // n
        model = _model().to(device)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        xs, ys = x[r * half:(r + 1) * half].to(device), y[r * half:(r + 1) * half].to(device)
        distributed = _train(model, opt, xs, ys)
        ref_model = _model().to(device)
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
        reference = _train(ref_model, ref_opt, x.to(device), y.to(device))
        return {"distributed": distributed, "reference": reference,
                "grad_device": all(on_device(p.grad) for p in model.parameters())}

    def sync_batch_norm():
        bn = hvd.SyncBatchNorm(3).to(device)
        x = torch.arange(12, dtype=torch.float32, device=device).reshape(4, 3) + 100 * r
        out = bn(x)
        full = torch.cat([torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * k for k in range(n)])
        expected = torch.nn.functional.batch_norm(full, None, None, training=True)[4 * r: 4 * (r + 1)]
        return {"device": on_device(out), "max_err": float((out.cpu() - expected).abs().max())}

    return [("allreduce", allreduce), ("others", others), ("autograd", autograd),
            ("optimizer", optimizer), ("optimizer_state", optimizer_state), ("sync_batch_norm", sync_batch_norm)]


@pytest.fixture(scope="module")
def cuda2() -> JobResults:
    one_gpu = torch.cuda.device_count() < 2
    return run_job(_sections, np=2, env={"HORA_NCCL": "off"} if one_gpu else None)


def test_cuda_allreduce_forms_stay_on_the_device_2ranks(cuda2):
    for r in range(2):
        out = cuda2.get("allreduce", r)
        assert all(out["devices"]) and out["inplace_is_input"]
        assert out["sum"] == [3.0 * i for i in range(6)]
        assert out["avg"] == [1.5 * i for i in range(6)]
        assert out["half"] == [3.0 * i for i in range(6)]
        assert out["bf16_max"] == [2.0 * i for i in range(6)]
        assert out["grouped"] == [[3.0 * i for i in range(6)], [1.0, 1.0]]


def test_cuda_gather_broadcast_alltoall_reducescatter_2ranks(cuda2):
    for r in range(2):
        out = cuda2.get("others", r)
        assert all(out["devices"])
        assert out["gathered"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert out["bcast"] == [1.0] * 3 and out["bcast_"] == [0.0] * 3
        assert out["a2a"] == ([0, 10] if r == 0 else [1, 2, 3, 11, 12, 13])
        assert out["splits"] == ([1, 1] if r == 0 else [3, 3])
        assert out["rs"] == [[3.0, 3.0], [3.0, 3.0]]


def test_cuda_allreduce_gradient_2ranks(cuda2):
    for r in range(2):
        out = cuda2.get("autograd", r)
        # Horovod's convention: the gradient of a Sum allreduce is the Sum allreduce of the gradient
        # (2 ranks x ones), then the chain rule's factor r + 1.
        assert out["device"] and out["grad"] == [2.0 * (r + 1)] * 3
        # allgather's gradient: the Average allreduce of the upstream gradient, this rank's rows.
        assert out["ag_device"] and out["ag_grad"] == [[3.0, 3.0]] * (r + 1)


def test_cuda_broadcast_optimizer_state_creates_and_copies_root_state_on_the_device_2ranks(cuda2):
    outs = cuda2.all("optimizer_state")
    assert all(all(o["devices"]) for o in outs)
    assert outs[0]["lr"] == outs[1]["lr"] == pytest.approx(0.01)
    assert outs[1]["exp_avg"] == outs[0]["exp_avg"] and any(v != 0 for v in outs[0]["exp_avg"][0])


def test_cuda_distributed_optimizer_matches_one_process_2ranks(cuda2):
    for r in range(2):
        out = cuda2.get("optimizer", r)
        assert out["grad_device"]
        for got, want in zip(out["distributed"], out["reference"]):
            assert got == pytest.approx(want, abs=1e-5)


def test_cuda_sync_batch_norm_uses_every_ranks_statistics_2ranks(cuda2):
    for r in range(2):
        out = cuda2.get("sync_batch_norm", r)
        assert out["device"] and out["max_err"] < 1e-4
