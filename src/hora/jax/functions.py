"""Making every rank start from the same state: parameter pytrees, optimizer states, Python objects.

jax arrays are immutable, so unlike horovod.torch's in-place ``broadcast_parameters`` these return the
broadcast pytree: ``params = hvd.broadcast_parameters(params, root_rank=0)``.
"""

from __future__ import annotations

from typing import Any

import jax

from hora import collectives
from hora.basics import ProcessSet, global_process_set
from hora.binding import batched
from hora.jax.arrays import new_like, to_host
from hora.jax.sharded_state import holds_sharded_state


def broadcast_parameters(params: Any, root_rank: int = 0, process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s pytree of arrays (model parameters, an optax state, ...) on every rank.

    All leaves travel as one fused group through host memory (once per job: GPU leaves are copied
    there and back, each result lands on its leaf's device); non-array leaves (Python numbers, None
    nodes) are left as they are on each rank (optax states carry none that differ). Outside jit only.
    """
    if holds_sharded_state(params):  # every rank holds one: each refuses, none waits on a broadcast
        raise ValueError("hora.jax: this pytree holds a sharded optimizer state (DistributedOptimizer with "
                         "shard_optimizer_state=True): each rank holds the state of its own shard only, so there is "
                         "no whole state on the root to send. Broadcast the parameters, then call the optimizer's "
                         "init on every rank")
    leaves, tree = jax.tree_util.tree_flatten(params)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    arrays = [to_host(leaves[i]) for i in positions]
    results = batched.broadcast_arrays(arrays, root_rank, process_set) if arrays else []
    out = list(leaves)
    for i, result in zip(positions, results):
        out[i] = new_like(result, leaves[i])
    return jax.tree_util.tree_unflatten(tree, out)


def broadcast_optimizer_state(opt_state: Any, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> Any:
    """An optax state is a pytree of arrays: the same as :func:`broadcast_parameters`."""
    return broadcast_parameters(opt_state, root_rank, process_set)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object on every rank of the process set."""
    return collectives.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order."""
    return collectives.allgather_object(obj, name, process_set)
