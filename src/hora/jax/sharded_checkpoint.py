"""Checkpoints of a sharded optax state that load at any number of ranks.

A :class:`~hora.jax.sharded_state.ShardedOptimizerState` holds the wrapped transformation's state over
this rank's leaves only, so a checkpoint of it is only good for the world that wrote it. Here the
shards are put together into the state the unsharded transformation would have over the whole
parameters (``consolidate_sharded_state``: on one rank, the others sending their shard there only),
which any run can keep, load unsharded, or cut again for its own number of ranks
(``reshard_state``).

Which parts of an optax state follow the parameters (Adam's two moments, a momentum) and which do not
(a step count) is optax's own knowledge: :func:`optax.tree_map_params` finds the parameter-shaped
trees by initialising the transformation on a placeholder. Each such tree's leaves are matched to
parameter positions; every other field is the same on every rank and is taken as it is.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np
import optax

from hora import basics, collectives
from hora.basics import ProcessSet, global_process_set
from hora.jax.sharded_state import ShardedOptimizerState, shard_positions


def _param_values(optimizer: Any, state: Any, positions: list[int]) -> tuple[dict[tuple[int, int], Any], list[Any]]:
    """``state``'s parameter-shaped leaves by (occurrence, position), and its other leaves in order:
    ``state`` is ``optimizer``'s over parameters laid out as ``positions`` says (a list of leaves)."""
    by_position: dict[tuple[int, int], Any] = {}
    seen: dict[int, int] = {}
    others: list[Any] = []

    def take(value: Any, position: int) -> Any:
        occurrence = seen.get(position, 0)
        seen[position] = occurrence + 1
        by_position[(occurrence, position)] = np.asarray(value)
        return value

    def keep(value: Any) -> Any:
        others.append(np.asarray(value) if isinstance(value, jax.Array) else value)
        return value

    optax.tree_map_params(optimizer, take, state, positions, transform_non_params=keep)
    return by_position, others


def _fill(optimizer: Any, template: Any, positions: Any, by_position: dict[tuple[int, int], Any],
          others: list[Any]) -> Any:
    """``template`` (``optimizer``'s state over parameters shaped like ``positions``) with its
    parameter-shaped leaves taken from ``by_position`` and its other leaves from ``others``, in order."""
    seen: dict[int, int] = {}
    rest = iter(others)

    def put(value: Any, position: int) -> Any:
        occurrence = seen.get(position, 0)
        seen[position] = occurrence + 1
        saved = by_position[(occurrence, position)]
        return jax.numpy.asarray(saved, dtype=value.dtype).reshape(value.shape)

    def other(value: Any) -> Any:
        saved = next(rest)
        return jax.numpy.asarray(saved, dtype=value.dtype) if isinstance(value, jax.Array) else saved

    return optax.tree_map_params(optimizer, put, template, positions, transform_non_params=other)


def _sharded_node(state: Any) -> ShardedOptimizerState:
    nodes = [node for node in jax.tree_util.tree_leaves(state, is_leaf=lambda n: isinstance(n, ShardedOptimizerState))
             if isinstance(node, ShardedOptimizerState)]
    if len(nodes) != 1:
        raise ValueError(f"expected the state of a DistributedOptimizer(shard_optimizer_state=True), holding one "
                         f"ShardedOptimizerState; this state holds {len(nodes)}")
    return nodes[0]


def _replace(state: Any, old: Any, new: Any) -> Any:
    return jax.tree_util.tree_map(lambda node: new if node is old else node, state,
                                  is_leaf=lambda n: n is old)


def consolidate_sharded_state(state: Any, optimizer: optax.GradientTransformation, params: Any,
                              root_rank: int = 0, process_set: ProcessSet = global_process_set) -> Any | None:
    """The state of a ``DistributedOptimizer(optimizer, shard_optimizer_state=True)`` as it would be
    unsharded (every ``ShardedOptimizerState`` replaced by ``optimizer``'s state over the whole
    ``params``), on ``root_rank``; None on the other ranks, which send their shard there only. Every
    rank of ``process_set`` calls it. ``optimizer`` is the transformation that was wrapped."""
    node = _sharded_node(state)
    leaves = jax.tree_util.tree_leaves(params)
    mine, others = _param_values(optimizer, node.inner, list(node.leaves))
    parts = _gather_to((mine, others), root_rank, process_set)
    if parts is None:
        return None
    merged: dict[tuple[int, int], Any] = {}
    for part, _ in parts:
        merged.update(part)
    missing = sorted(set(range(len(leaves))) - {position for _, position in merged})
    if merged and missing:
        raise ValueError(f"the shards together lack the state of leaves {missing[:20]}: the state was made "
                         f"for other parameters or another number of ranks")
    template = optimizer.init(params)
    positions = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), list(range(len(leaves))))
    whole = _fill(optimizer, template, positions, merged, parts[0][1])
    return _replace(state, node, whole)


def reshard_state(whole: Any, optimizer: optax.GradientTransformation, params: Any,
                  process_set: ProcessSet = global_process_set) -> ShardedOptimizerState:
    """This rank's ``ShardedOptimizerState`` for the world as it is now, from ``whole``: ``optimizer``'s
    unsharded state over ``params`` (from :func:`consolidate_sharded_state`, at any number of ranks, or
    from an unsharded run). Every rank passes the whole state; each keeps its own leaves'."""
    leaves = jax.tree_util.tree_leaves(params)
    positions = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), list(range(len(leaves))))
    by_position, others = _param_values(optimizer, whole, positions)
    mine = list(shard_positions(leaves, process_set))
    template = optimizer.init([leaves[i] for i in mine])
    return ShardedOptimizerState(_fill(optimizer, template, mine, by_position, others), tuple(mine))


def _gather_to(obj: Any, root_rank: int, process_set: ProcessSet) -> list[Any] | None:
    """Every member's ``obj`` on ``root_rank`` (member order), None elsewhere: an alltoall in which
    each member sends to the root only, so no other rank holds more than its own shard."""
    if len(process_set.ranks) == 1:
        return [obj]
    if root_rank not in process_set.ranks:
        raise ValueError(f"root_rank {root_rank} is not in the process set (ranks {process_set.ranks})")
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    splits = [0] * len(process_set.ranks)
    splits[process_set.ranks.index(root_rank)] = data.size
    received, sizes = collectives.alltoall(data, splits=splits, process_set=process_set)
    if basics.rank() != root_rank:
        return None
    out, offset = [], 0
    for size in np.asarray(sizes).tolist():
        out.append(pickle.loads(received[offset:offset + size].tobytes()))
        offset += size
    return out
