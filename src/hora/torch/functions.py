"""Helpers that make every rank start from the same state: parameters, optimizer state, objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hora import collectives
from hora.basics import ProcessSet, global_process_set
from hora.torch import mpi_ops
from hora.torch.optimizer import _DistributedOptimizer, _DistributedStatefulOptimizer, _ShardedDistributedOptimizer
from hora.torch.zero import ZeroRedundancyOptimizer


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable, root_rank: int) -> None:
    """Overwrite parameters on every rank with ``root_rank``'s, in place.

    ``params`` is a ``state_dict()``, ``model.named_parameters()``, or a list of tensors.
    """
    items: list[Any]
    if isinstance(params, Mapping):
        items = list(params.items())
    else:
        items = list(params)
        if items and not isinstance(items[0], tuple):
            items = [(str(i), p) for i, p in enumerate(items)]
    handles = []
    for name, p in items:
        if p is None or not isinstance(p, torch.Tensor):
            continue
        handles.append(mpi_ops.broadcast_async_(p, root_rank, name=f"broadcast.parameter.{name}"))
    for handle in handles:
        mpi_ops.synchronize(handle)


def _base_step(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, _DistributedOptimizer):
        # The wrapped class's own step, past the wrapper in the MRO: no allreduce (the gradients are
        # all zero anyway), and right however the wrapped class was subclassed since.
        super(_DistributedOptimizer, optimizer).step()
    else:
        optimizer.step()


def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create lazily built state (Adam's moments, ...) for the parameters that have none yet, by a
    step on zero gradients for those parameters alone: the others get no gradient for that step,
    so optimizers skip them and their state stays as it was; weights are restored afterwards."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    lacking = {p for p in params if not optimizer.state.get(p)}
    if not lacking:
        return
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)  # it takes sparse gradients only (as Horovod does)
    for p in params:
        if p in lacking:
            p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
        else:
            p.grad = None
    try:
        _base_step(optimizer)
    finally:
        with torch.no_grad():
            for p, data, grad in saved:
                p.copy_(data)
                p.grad = grad


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Give every rank ``root_rank``'s optimizer state: hyper-parameters and per-parameter tensors."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (it keeps Python lists of history)")
    if isinstance(optimizer, (ZeroRedundancyOptimizer, _ShardedDistributedOptimizer)):
        # Each rank holds the state of its own shard only: there is no whole state on the root to send.
        raise ValueError("broadcast_optimizer_state: a ZeroRedundancyOptimizer's (or a DistributedOptimizer's with "
                         "shard_optimizer_state=True) state is sharded across the "
                         "ranks. To give every rank the same state, call optimizer.consolidate_state_dict(to=root) "
                         "on every rank, broadcast optimizer.state_dict() from the root (hvd.broadcast_object) and "
                         "pass it to optimizer.load_state_dict() on every rank: each keeps its own shard")
    _initialise_state(optimizer)
    # Scalar hyper-parameters (lr, momentum, betas, ...) travel as one object.
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    groups = collectives.broadcast_object(groups, root_rank, name="broadcast.optimizer.param_groups")
    for group, values in zip(optimizer.param_groups, groups):
        group.update(values)
    # Per-parameter state: tensors in place, other values (ints, ...) as one object.
    handles = []
    scalars: dict[str, Any] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key in sorted(optimizer.state.get(p, {})):
                value = optimizer.state[p][key]
                name = f"{index}.{key}"
                if isinstance(value, torch.Tensor):
                    handles.append(mpi_ops.broadcast_async_(value, root_rank, name=f"broadcast.optimizer.{name}"))
                else:
                    scalars[name] = value
            index += 1
    for handle in handles:
        mpi_ops.synchronize(handle)
    scalars = collectives.broadcast_object(scalars, root_rank, name="broadcast.optimizer.scalars")
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key in list(optimizer.state.get(p, {})):
                name = f"{index}.{key}"
                if name in scalars:
                    optimizer.state[p][key] = scalars[name]
            index += 1
    if isinstance(optimizer, _DistributedStatefulOptimizer):
        # PowerSGD's or top-k's step count and shared factors: without them a rank that joined a
        # running job would warm up while the others compress, and their collectives would differ.
        reducer = optimizer._step_reducer
        reducer.load_shared_state(collectives.broadcast_object(reducer.shared_state(), root_rank,
                                                               name="broadcast.optimizer.reducer"))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object on every rank."""
    return collectives.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order."""
    return collectives.allgather_object(obj, name, process_set)
