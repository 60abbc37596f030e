"""What a benchmark's ranks share whichever framework moves the gradients: the slowest rank's time,
a barrier, and the shutdown, for hora.torch and for torch.distributed (Gloo) alike.

The timed figures of a data-parallel step are the slowest rank's (the others wait for it at the next
collective), so every contender reports the maximum over ranks, through its own collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RankSync:
    slowest: Callable[[float], float]  #: the largest value over the ranks
    barrier: Callable[[], None]
    done: Callable[[], None]  #: shut the framework's collectives down


def hora_sync() -> RankSync:
    """Through hora.torch (``hvd.init()`` called already)."""
    import torch

    import hora.torch as hvd

    def slowest(value: float) -> float:
        return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), name="bench.slowest",
                                   op=hvd.Max).item())

    def barrier() -> None:
        hvd.allreduce(torch.zeros(1), name="bench.barrier")

    return RankSync(slowest, barrier, hvd.shutdown)


def gloo_sync() -> RankSync:
    """Through torch.distributed (its process group initialised already)."""
    import torch
    import torch.distributed as dist

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    return RankSync(slowest, dist.barrier, dist.destroy_process_group)
