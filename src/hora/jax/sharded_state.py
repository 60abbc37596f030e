"""Optax state sharded across ranks (ZeRO stage 1), behind ``DistributedOptimizer(shard_optimizer_state=True)``.

Every rank reduces the whole gradient as without sharding, then runs the wrapped transformation on its
own shard of the leaves only, so it holds that shard's state (Adam's two moments) and no other. The
shards are :mod:`hora.binding.shard_plan`'s: contiguous runs of the leaves in ``tree_flatten`` order,
balanced by bytes, a leaf never split, the same plan on every rank with nothing exchanged. The updates
then travel back with one allgather per dtype, each rank's run padded to the longest so that every
shape is fixed when tracing: the same code runs eagerly and inside ``jax.jit``.

The result equals the unsharded optimizer's for transformations that treat each leaf on its own (sgd,
momentum, adam, adamw, rmsprop, ...). A transformation that looks across leaves, such as
``optax.clip_by_global_norm``, would see only the shard's leaves: put it outside the wrapper, or leave
the state unsharded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hora.basics import ProcessSet
from hora.binding.shard_plan import ShardPlan, plan_shards
from hora.jax import mpi_ops


@jax.tree_util.register_pytree_node_class
class ShardedOptimizerState:
    """The wrapped transformation's state over this rank's shard of the leaves (``inner``, over a list of
    leaves in ``tree_flatten`` order) and which positions those are on this rank (``leaves``). The
    positions are the pytree's static part: ``jax.jit`` traces the state, never them."""

    __slots__ = ("inner", "leaves")

    def __init__(self, inner: Any, leaves: tuple[int, ...]) -> None:
        self.inner, self.leaves = inner, tuple(leaves)

    def tree_flatten(self) -> tuple[tuple[Any], tuple[int, ...]]:
        return (self.inner,), self.leaves

    @classmethod
    def tree_unflatten(cls, leaves: tuple[int, ...], children: Any) -> ShardedOptimizerState:
        return cls(children[0], leaves)

    def __repr__(self) -> str:
        return f"ShardedOptimizerState(inner={self.inner!r}, leaves={self.leaves})"


def _plan(leaves: list[Any], process_set: ProcessSet) -> ShardPlan:
    sizes = [int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize for leaf in leaves]
    return plan_shards(sizes, process_set.size())


def shard_positions(leaves: list[Any], process_set: ProcessSet) -> range:
    """Positions (in ``tree_flatten`` order) of the leaves this rank of ``process_set`` owns."""
    return _plan(leaves, process_set).items(process_set.rank())


def _gather_updates(owned: dict[int, Any], leaves: list[Any], plan: ShardPlan, name: str,
                    process_set: ProcessSet) -> list[Any]:
    """Every leaf's update on every rank, from each rank's updates of the leaves it owns: per dtype, the
    owned leaves flattened into one run (contiguous, since the shards are), padded to the longest
    rank's run, gathered, and cut back into leaves."""
    dtypes: list[np.dtype] = []
    for leaf in leaves:
        if np.dtype(leaf.dtype) not in dtypes:
            dtypes.append(np.dtype(leaf.dtype))
    counts = [int(np.prod(leaf.shape, dtype=np.int64)) for leaf in leaves]
    mine = set(owned)
    runs, layouts = [], []
    for dtype in dtypes:
        positions = [i for i, leaf in enumerate(leaves) if np.dtype(leaf.dtype) == dtype]
        per_rank = [[i for i in positions if i in plan.items(r)] for r in range(plan.ranks)]
        longest = max(sum(counts[i] for i in run) for run in per_rank)
        if longest == 0:
            continue
        pieces = [jnp.ravel(owned[i]).astype(dtype) for i in positions if i in mine]
        run = jnp.concatenate(pieces) if pieces else jnp.zeros((0,), dtype)
        runs.append(jnp.pad(run, (0, longest - run.shape[0])))
        layouts.append((per_rank, longest))
    gathered = mpi_ops.grouped_allgather(runs, f"{name}.sharded_updates", process_set) if runs else []
    out: list[Any] = [None] * len(leaves)
    for flat, (per_rank, longest) in zip(gathered, layouts):
        for r, run in enumerate(per_rank):
            offset = r * longest
            for i in run:
                out[i] = flat[offset:offset + counts[i]].reshape(leaves[i].shape)
                offset += counts[i]
    return out


def sharded(inner: optax.GradientTransformationExtraArgs, reduce: Callable[[Any], Any], name: str,
            process_set: ProcessSet) -> optax.GradientTransformationExtraArgs:
    """``inner`` stepping this rank's shard of the leaves, on gradients ``reduce`` makes whole first."""

    def init(params: Any) -> ShardedOptimizerState:
        leaves = jax.tree_util.tree_leaves(params)
        mine = shard_positions(leaves, process_set)
        return ShardedOptimizerState(inner.init([leaves[i] for i in mine]), tuple(mine))

    def update(grads: Any, state: ShardedOptimizerState, params: Any = None,
               **extra: Any) -> tuple[Any, ShardedOptimizerState]:
        leaves, tree = jax.tree_util.tree_flatten(reduce(grads))
        plan = _plan(leaves, process_set)
        mine = list(plan.items(process_set.rank()))
        if tuple(mine) != tuple(state.leaves):
            raise ValueError(f"hora.jax rank {process_set.rank()}: this sharded optimizer state covers leaves "
                             f"{list(state.leaves)}, but the gradients' shard plan gives this rank {mine}: the "
                             f"state was made for other parameters or another number of ranks; call init again")
        owned_params = None
        if params is not None:
            param_leaves = jax.tree_util.tree_leaves(params)
            owned_params = [param_leaves[i] for i in mine]
        updates, new_inner = inner.update([leaves[i] for i in mine], state.inner, owned_params, **extra)
        whole = _gather_updates(dict(zip(mine, updates)), leaves, plan, name, process_set)
        return jax.tree_util.tree_unflatten(tree, whole), ShardedOptimizerState(new_inner, state.leaves)

    return optax.GradientTransformationExtraArgs(init, update)


def holds_sharded_state(tree: Any) -> bool:
    """Whether a pytree holds a :class:`ShardedOptimizerState` anywhere."""
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=lambda node: isinstance(node, ShardedOptimizerState))
    return any(isinstance(node, ShardedOptimizerState) for node in nodes)
