"""memory_report: the bytes an optimizer keeps on this rank, to see what sharding saves.

It reads only what every torch optimizer exposes (``param_groups`` and ``state``), so one function
serves a plain optimizer, hora's ``DistributedOptimizer`` and the sharded optimizers
(``ZeroRedundancyOptimizer``, ``DistributedOptimizer(shard_optimizer_state=True)``), whose ``state``
is this rank's shard while ``param_groups`` hold every parameter. It counts tensors that exist now,
not allocator peaks: run it after a step, when the gradients and the state are there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank, by kind."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def _nbytes(tensor: torch.Tensor) -> int:
    if tensor.is_sparse:
        return _nbytes(tensor._values()) + _nbytes(tensor._indices())
    return tensor.numel() * tensor.element_size()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def memory_report(optimizer: torch.optim.Optimizer) -> MemoryReport:
    """Bytes of parameters, gradients and optimizer state that ``optimizer`` holds on this rank
    (each tensor counted once, however often it is referenced)."""
    params = list({id(p): p for group in optimizer.param_groups for p in group["params"]}.values())
    state = {id(t): t for t in _tensors(dict(optimizer.state))}
    return MemoryReport(
        parameters=sum(_nbytes(p) for p in params),
        gradients=sum(_nbytes(p.grad) for p in params if p.grad is not None),
        optimizer_state=sum(_nbytes(t) for t in state.values()),
    )
