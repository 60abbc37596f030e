"""The model, data and helpers both ZeRO test modules train with (test_zero.py, test_sharded_optimizer.py).

One definition, so that the standalone ZeroRedundancyOptimizer and the sharded DistributedOptimizer
are held to the same model: parameters of uneven sizes (uneven shards), one float64 parameter (a
second dtype, so a second bucket) and one frozen parameter (left out of every collective). Imported
by name in the workers too (hora.run hands them the test process's sys.path).
"""

from __future__ import annotations

import torch

BATCH = 24  # global batch: 12 rows per rank on 2 ranks, 8 on 3
TOL = dict(rtol=1e-5, atol=1e-6)


class Net(torch.nn.Module):
    """Parameters of uneven sizes, one float64 parameter and one frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 2)
        self.scale = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.shift = torch.nn.Parameter(torch.full((2,), 0.1), requires_grad=False)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(h) * self.scale.to(torch.float32) + self.shift


def make_model(seed: int = 1) -> Net:
    torch.manual_seed(seed)
    return Net()


NAMES = [name for name, _ in Net().named_parameters()]  # a module's own parameters come first
FROZEN = NAMES.index("shift")


def data(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 2, generator=g)


def shard(step: int, r: int, n: int):
    x, y = data(step)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
    return x[rows], y[rows]


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def weights(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


#: The two optimizers every equivalence check runs: the class and its settings.
ADAM = (torch.optim.Adam, {"lr": 0.01})
SGD_MOMENTUM = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


def assert_close_lists(got, want, **tol):
    tol = tol or TOL
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol)
