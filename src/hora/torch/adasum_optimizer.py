"""DistributedOptimizer(op=hvd.Adasum): Horovod's Adasum optimizer, which reduces weight updates, not gradients.

Adasum needs the full magnitude of what it combines, and a gradient is not yet an update (momentum,
Adam's scaling). So, as in Horovod, every rank first takes a *local* step of the wrapped optimizer on
its own gradients, the difference between the weights after and before (the delta) is combined across
ranks with Adasum, and every rank sets its weights to the starting weights plus the combined delta.
Each rank's optimizer state (momentum, Adam's moments) stays its own, as in Horovod.

Differences from Horovod, written down in docs/transports-and-tuning.md: Horovod starts each
parameter's local step and delta reduction from the backward hook, once its gradient is ready; here the
local step runs in ``step()`` and the deltas are submitted together (the engine fuses them), so the
reduction does not overlap the backward pass. ``synchronize()`` has nothing to wait for.
"""

from __future__ import annotations

import warnings

import torch

from hora.basics import Adasum
from hora.torch import mpi_ops
from hora.torch.optimizer import _DistributedOptimizer


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """Mixed in before the wrapped optimizer's class instead of :class:`_DistributedOptimizer`."""

    def _hora_setup(self, *args, **kwargs) -> None:
        super()._hora_setup(*args, **kwargs)
        if self._groups:
            warnings.warn("DistributedOptimizer(op=Adasum): groups are not used; every parameter's delta is "
                          "submitted at step() and the engine fuses them, each keeping its own Adasum "
                          "coefficients", UserWarning, stacklevel=4)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Nothing starts during the backward pass: the deltas exist only after the local step."""

    def synchronize(self) -> None:
        """Nothing to wait for: with Adasum, ``step()`` reduces the deltas of its own local step."""
        self._synchronized = True

    def step(self, closure=None):
        """A local step on this rank's gradients, then the weights become the starting weights plus the
        Adasum of every rank's delta."""
        local_step = super(_DistributedOptimizer, self).step  # the wrapped optimizer's own step
        if self._excluded:
            return local_step(closure)
        params = self._requires_update
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
        loss = local_step(closure)
        pending = []
        with torch.no_grad():
            for p, start in zip(params, starts):
                delta = p.detach() - start  # zero where this rank had no gradient: Adasum leaves others as they are
                compressed, ctx = self._compression.compress(delta)
                handle = mpi_ops.allreduce_async_(compressed, name=f"{self._names[p]}.adasum_delta", op=Adasum,
                                                  process_set=self._process_set)
                pending.append((p, start, handle, ctx))
            for p, start, handle, ctx in pending:
                combined = self._compression.decompress(mpi_ops.synchronize(handle), ctx)
                p.copy_(start + combined.to(start.dtype))
        self._synchronized = False
        return loss
