"""The torch extra alone: hora.torch's allreduce, broadcast_parameters and one DistributedOptimizer
step on 2 ranks, started by ``hora run -np 2``.

Each rank starts from different weights and trains on different data, so the only way both ranks end
with the weights the test expects is that rank 0's weights were broadcast and the two gradients were
averaged: w = [0.5, -0.25, 1.0], rank r's rows are (r + 1) * [1, 1, 1], the loss is the mean of
(x . w)^2, so the local gradients are 2.5 and 10.0 per weight, their average 6.25, and one SGD step
of 0.1 gives [-0.125, -0.875, 0.375].
"""

from __future__ import annotations

import torch
from smoke_report import report  # this folder: on the path of a script run from it

import hora.torch as hvd


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    summed = hvd.allreduce(torch.tensor([1.0 + rank, 10.0]), op=hvd.Sum, name="smoke.sum")

    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.25, 1.0]]) if rank == 0 else torch.zeros(1, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    x = torch.full((4, 3), float(rank + 1))
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    report({
        "rank": rank, "size": hvd.size(), "sum": summed.tolist(),
        "grad": model.weight.grad.flatten().tolist(), "weights": model.weight.detach().flatten().tolist(),
        "cuda_build": torch.version.cuda,
    })
    hvd.shutdown()


if __name__ == "__main__":
    main()
