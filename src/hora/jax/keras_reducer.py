"""The gradient reduction ``hora.keras.DistributedOptimizer`` uses when Keras 3 runs on JAX.

Keras's JAX trainer compiles ``train_step`` with ``jax.jit``, and the optimizer's ``apply`` runs inside
it on tracers. This reducer hands every gradient of the step to :func:`hora.jax.grouped_allreduce`,
which stages one ordered host callback for them all: the compiled step stops once per step to average
on the host and then continues; ``run_eagerly=True`` takes the direct path instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hora import horovod_args
from hora.basics import ProcessSet
from hora.horovod_args import GradientReduction
from hora.jax import mpi_ops


class JaxAllreducer:
    """``reducer(grads, sources) -> reduced grads``, as hora.keras's optimizer wrapper calls it."""

    def __init__(self, prefix: str, compression, op: int, gradient_predivide_factor: float, groups: Any,
                 process_set: ProcessSet) -> None:
        self.reduction = GradientReduction.create(op, gradient_predivide_factor, process_set)
        self.prefix, self.compression, self.groups = prefix, compression, groups

    def __call__(self, grads: Sequence[Any], sources: Sequence[Any] | None) -> list[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        out = list(grads)
        r = self.reduction
        positions = horovod_args.group_positions(self.groups, sources)
        # Without groups, one fused unit: under jit each unit costs one host callback per step.
        units = horovod_args.partition(present, positions) if positions is not None else [present] * bool(present)
        for group_index, group in enumerate(units):
            reduced = mpi_ops.grouped_allreduce([grads[i] for i in group], None,
                                                f"{self.prefix}.group{group_index}", self.compression, r.op,
                                                r.prescale_factor, r.postscale_factor, r.process_set)
            for i, value in zip(group, reduced):
                out[i] = value
        return out
