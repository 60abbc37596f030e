"""``DistributedOptimizer`` for optax: the wrapped transformation sees gradients reduced across ranks.

The wrapper is itself an optax ``GradientTransformation``, so it drops in where the optimizer was:
``tx = hvd.DistributedOptimizer(optax.adam(1e-3))``, then ``tx.init(params)`` and
``tx.update(grads, state, params)`` as before, inside or outside ``jax.jit``. Each ``update`` reduces
all gradient leaves as one fused group (one host callback per step under jit, see
:mod:`hora.jax.mpi_ops`) and hands the result to the wrapped transformation.

With ``backward_passes_per_step`` k > 1, ``update`` is called once per micro-batch: gradients are
summed locally (averaged with ``average_aggregated_gradients``) and every k-th call reduces the sum
across ranks and runs the wrapped transformation; the calls in between return zero updates and leave
its state alone, as Horovod's optimizers only step every k passes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hora import basics, horovod_args
from hora.basics import Average, ProcessSet, global_process_set
from hora.compression import Compression
from hora.horovod_args import GradientReduction
from hora.jax import mpi_ops, sharded_state
from hora.jax.arrays import is_traced


class AggregationState(NamedTuple):
    """The wrapper's state when ``backward_passes_per_step`` > 1 (else it is the wrapped state itself)."""

    inner: Any
    sums: Any  # local gradient sums, a pytree like the gradients
    count: jax.Array  # calls since the last reduction


def _reducer(reduction: GradientReduction, compression, name: str):
    def reduce(grads: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(grads)
        out = mpi_ops.grouped_allreduce(leaves, None, name, compression, reduction.op, reduction.prescale_factor,
                                        reduction.postscale_factor, reduction.process_set)
        return jax.tree_util.tree_unflatten(tree, out)
    return reduce


def DistributedOptimizer(optimizer: optax.GradientTransformation, name: str | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         process_set: ProcessSet = global_process_set, *,
                         shard_optimizer_state: bool = False) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax transformation so that its ``update`` sees gradients averaged (or summed, ``op``)
    across the ranks of ``process_set``; ``compression`` is hora's ``Compression`` (fp16 on the wire).

    ``shard_optimizer_state=True`` (a hora addition, ZeRO stage 1): gradients are reduced as without it,
    but each rank keeps the wrapped transformation's state for its own shard of the leaves only and
    steps only those; one allgather per dtype brings every leaf's update to every rank
    (:mod:`hora.jax.sharded_state`, docs/memory.md). For transformations that treat each leaf on its own.
    """
    if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
        raise TypeError(f"hora.jax.DistributedOptimizer wraps an optax GradientTransformation, "
                        f"got {type(optimizer).__name__}")
    basics.engine()  # fail early, with the init() message, when hora is not initialised
    passes = horovod_args.backward_passes(backward_passes_per_step)
    compression = horovod_args.check_compression(compression)
    name = name if name is not None else "DistributedOptimizer"
    reduce = _reducer(GradientReduction.create(op, gradient_predivide_factor, process_set), compression, name)
    wrapped = optax.with_extra_args_support(optimizer)
    if shard_optimizer_state:
        inner = sharded_state.sharded(wrapped, reduce, name, process_set)  # reduces, then steps its shard
    else:
        def update_now(grads, state, params=None, **extra):
            return wrapped.update(reduce(grads), state, params, **extra)

        inner = optax.GradientTransformationExtraArgs(wrapped.init, update_now)
    if passes == 1:
        return inner

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return AggregationState(inner.init(params), zeros, jnp.zeros((), jnp.int32))

    def update(grads, state: AggregationState, params=None, **extra):
        sums = jax.tree_util.tree_map(jnp.add, state.sums, grads)
        count = state.count + 1

        def step(_):
            total = jax.tree_util.tree_map(lambda s: s / passes, sums) if average_aggregated_gradients else sums
            updates, new_inner = inner.update(total, state.inner, params, **extra)
            return updates, AggregationState(new_inner, jax.tree_util.tree_map(jnp.zeros_like, sums),
                                             jnp.zeros((), jnp.int32))

        def accumulate(_):
            return jax.tree_util.tree_map(jnp.zeros_like, grads), AggregationState(state.inner, sums, count)

        if not is_traced(count):  # eager: branch in Python (lax.cond would compile both branches each time)
            return step(None) if int(count) == passes else accumulate(None)
        return jax.lax.cond(count == passes, step, accumulate, None)

    return optax.GradientTransformationExtraArgs(init, update)
