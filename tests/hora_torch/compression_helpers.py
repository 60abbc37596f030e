"""What the PowerSGD and top-k tests share: a one-rank communicator for driving a reducer without
processes, ResNet-18's parameter shapes, and the checkpoint round trip of a compressed
DistributedOptimizer run inside a job."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch


class OneRank:
    """The communicator of a world of one: averaging and gathering are the identity. Records the
    name of each call and the elements it was handed."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size
        self.calls: list[tuple[str, int]] = []

    def world(self) -> tuple[int, int]:
        return self.rank, self.size

    def start_average(self, tensors: list[torch.Tensor], name: str) -> Callable[[], None]:
        self.calls.append((name, sum(t.numel() for t in tensors)))
        return lambda: None

    def start_gather(self, tensors: list[torch.Tensor], name: str) -> Callable[[], list[torch.Tensor]]:
        self.calls.append((name, sum(t.numel() for t in tensors)))
        return lambda: [t.clone() for t in tensors]


def resnet18_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """torchvision's resnet18() parameters (names and shapes), without torchvision."""
    shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    cin = 64
    for layer, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            p = f"layer{layer}.{block}"
            shapes += [(f"{p}.conv1.weight", (cout, cin if block == 0 else cout, 3, 3)),
                       (f"{p}.bn1.weight", (cout,)), (f"{p}.bn1.bias", (cout,)),
                       (f"{p}.conv2.weight", (cout, cout, 3, 3)), (f"{p}.bn2.weight", (cout,)),
                       (f"{p}.bn2.bias", (cout,))]
            if block == 0 and cin != cout:
                shapes += [(f"{p}.downsample.0.weight", (cout, cin, 1, 1)), (f"{p}.downsample.1.weight", (cout,)),
                           (f"{p}.downsample.1.bias", (cout,))]
        cin = cout
    return shapes + [("fc.weight", (1000, 512)), ("fc.bias", (1000,))]


RESNET18_PARAMETERS = 11_689_512  # torchvision.models.resnet18(): sum of p.numel()


def resumed_difference(make: Callable[[], tuple[torch.nn.Module, Any]],
                       loss: Callable[[torch.nn.Module, int], torch.Tensor], steps: int = 6) -> float:
    """The largest weight difference between ``steps`` uninterrupted steps and a run stopped halfway,
    saved (model and optimizer ``state_dict()``, each rank its own) and resumed in new objects."""

    def train(model: torch.nn.Module, opt: Any, span: range) -> None:
        for step in span:
            opt.zero_grad()
            loss(model, step).backward()
            opt.step()

    whole_model, whole_opt = make()
    train(whole_model, whole_opt, range(steps))
    model, opt = make()
    train(model, opt, range(steps // 2))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model, resumed_opt = make()
    resumed_model.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed_model, resumed_opt, range(steps // 2, steps))
    return max((a - b).abs().max().item() for a, b in zip(whole_model.parameters(), resumed_model.parameters()))
