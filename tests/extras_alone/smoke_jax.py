"""The jax extra alone: hora.jax's allreduce of a jax.Array, broadcast_parameters of a pytree and one
step of an optax optimizer wrapped in hora.jax's DistributedOptimizer, on 2 ranks (``hora run -np 2``).

The same arithmetic as smoke_torch.py: rank 0's [0.5, -0.25, 1.0] broadcast over rank 1's zeros,
rows of (rank + 1) * [1, 1, 1], local gradients 2.5 and 10.0, averaged 6.25 inside the optimizer's
update, one SGD step of 0.1 to [-0.125, -0.875, 0.375] on both ranks.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax
from smoke_report import report  # this folder: on the path of a script run from it

import hora.jax as hvd


def main() -> None:
    hvd.init()
    rank = hvd.rank()
    summed = hvd.allreduce(jnp.array([1.0 + rank, 10.0]), op=hvd.Sum, name="smoke.sum")

    start = jnp.array([0.5, -0.25, 1.0]) if rank == 0 else jnp.zeros(3)
    params = hvd.broadcast_parameters({"w": start}, root_rank=0)
    x = jnp.full((4, 3), float(rank + 1))
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)

    report({
        "rank": rank, "size": hvd.size(), "sum": [float(v) for v in summed],
        "is_jax_array": isinstance(summed, jax.Array),
        "update": [float(v) for v in updates["w"]], "weights": [float(v) for v in params["w"]],
        "jax": jax.__version__,
    })
    hvd.shutdown()


if __name__ == "__main__":
    main()
