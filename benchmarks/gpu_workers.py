"""What benchmarks/gpu_suite.py runs on each rank: training throughput and the killed-peer check.

Kept apart from the suite's driver so that the driver imports no torch: on a machine without a GPU
the suite refuses in one line before any framework loads.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainConfig:
    """One throughput comparison: contenders take turns, ``rounds`` times, on the same model and batch."""

    modes: tuple[str, ...]  # "plain" (no hora), "hora" (DistributedOptimizer), "ddp" (DDP over Gloo)
    precisions: tuple[str, ...] = ("fp32",)  # "fp32", "bf16" (torch.autocast on CUDA)
    model: str = "resnet50"
    batch: int = 64
    image: int = 224
    steps: int = 30
    warmup: int = 10
    rounds: int = 3
    ddp_port: int = 0
    device: str = "cuda"  # "cpu" only to check the suite itself on a machine without a GPU


def _model(name: str) -> Any:
    if name == "tiny":  # no torchvision needed: for checking the suite itself on a CPU
        import torch

        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(8, 1000))
    import torchvision

    return getattr(torchvision.models, name)(num_classes=1000)


class _Contender:
    """One mode's model, optimizer and step function on this rank's GPU."""

    def __init__(self, mode: str, precision: str, cfg: TrainConfig, device: Any) -> None:
        import torch

        import hora.torch as hvd

        torch.manual_seed(0)
        model = _model(cfg.model).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if mode == "hora":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        elif mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        self.model, self.optimizer = model, optimizer
        generator = torch.Generator(device="cpu").manual_seed(1)
        self.x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=generator).to(device)
        self.y = torch.randint(0, 1000, (cfg.batch,), generator=generator).to(device)
        self.amp = precision == "bf16"
        self.warmed = False

    def step(self) -> None:
        import torch

        self.optimizer.zero_grad()
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()


def train(cfg: TrainConfig) -> dict[str, dict[str, list[float]]]:
    """This rank's seconds for ``cfg.steps`` steps, per ``mode/precision`` and round (every rank takes
    the same turns, in the same order), with the CPU seconds the process and its main thread spent.

    Each turn starts from a barrier and ends when this rank's GPU is done, so the slowest rank's
    seconds are the job's. The CPU figures tell a GPU-bound step (CPU time well under wall time,
    the host runs ahead) from one the host holds back.
    """
    import torch

    import hora.torch as hvd

    hvd.init()
    device = _device(cfg.device, hvd.local_rank())
    torch.backends.cudnn.benchmark = True
    if "ddp" in cfg.modes:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg.ddp_port}",
                                             rank=hvd.rank(), world_size=hvd.size())
    contenders = {f"{mode}/{precision}": _Contender(mode, precision, cfg, device)
                  for precision in cfg.precisions for mode in cfg.modes}
    measured: dict[str, dict[str, list[float]]] = {
        what: {key: [] for key in contenders} for what in ("seconds", "process_cpu", "thread_cpu")}
    for _ in range(cfg.rounds):
        for key, contender in contenders.items():
            for _ in range(cfg.warmup if not contender.warmed else 2):
                contender.step()
            contender.warmed = True
            _synchronize(device)
            hvd.allreduce(torch.zeros(1), name="gpu_suite.barrier")  # host tensor: a CPU barrier
            start, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(cfg.steps):
                contender.step()
            _synchronize(device)
            measured["seconds"][key].append(time.perf_counter() - start)
            measured["process_cpu"][key].append(time.process_time() - process)
            measured["thread_cpu"][key].append(time.thread_time() - thread)
    if "ddp" in cfg.modes:
        torch.distributed.destroy_process_group()
    return measured


def _device(kind: str, local_rank: int) -> Any:
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def killed_peer(folder: str, size_bytes: int, victim: int = 1, kill_at_step: int = 20,
                device_kind: str = "cuda") -> None:
    """Allreduces of a CUDA tensor until rank ``victim`` kills itself with SIGKILL; every other rank
    writes when and how its hora call failed (the launcher's SIGTERM is ignored so that it can)."""
    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    device = _device(device_kind, hvd.local_rank())
    if rank != victim:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tensor = torch.ones(size_bytes // 4, device=device)
    record: dict[str, Any] = {"rank": rank}
    step = 0
    try:
        while step < 1_000_000:
            step += 1
            if rank == victim and step == kill_at_step:
                _write(os.path.join(folder, f"rank{rank}.json"), {"rank": rank, "died_at": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)
            hvd.allreduce_(tensor, name="gpu_suite.killed")
            _synchronize(device)
        record["error"] = None
    except Exception as exc:  # what the suite reports
        record.update(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300], type=type(exc).__name__,
                      raised_at=time.time(), step=step)
    _write(os.path.join(folder, f"rank{rank}.json"), record)


def _write(path: str, record: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(record, handle)
    os.replace(tmp, path)
