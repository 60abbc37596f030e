"""Elastic training for PyTorch: ``run``, ``TorchState`` and ``ElasticSampler`` (horovod.torch.elastic's names).

``run`` re-forms the world through the next rendezvous round in the same process
(``hora.shutdown()`` then ``hora.init()``; the elastic driver of ``hora run --min-np ...`` opens that
round with the new hosts), ``TorchState`` commits, restores and syncs a model, its optimizer, LR
schedulers, an ``ElasticSampler`` and any picklable attribute, and ``ElasticSampler`` resumes an epoch
where the committed state left it, re-sharded over the new world.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from hora import basics
from hora.elastic import ObjectState, run
from hora.torch import zero_elastic
from hora.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.torch.zero import ZeroRedundancyOptimizer
from hora.torch.zero_state import hyperparameters

__all__ = ["run", "TorchState", "ElasticSampler"]


class ElasticSampler(Sampler):
    """Shards one epoch of ``dataset`` over the workers and resumes it after a reset.

    Every rank computes the same order of the epoch (a permutation seeded by ``seed + epoch`` when
    ``shuffle``, else index order) and takes every ``size``-th not-yet-processed index of it starting
    at its rank. Nothing is padded: an index appears in exactly one shard, so shard lengths differ by
    at most one (a training loop that needs the same number of batches on every rank must allow for
    that last uneven batch). ``reset()`` (called by ``set_epoch``, ``load_state_dict`` and by
    ``TorchState.sync`` after the world is re-formed) re-shards the indices not yet processed in this
    epoch over the current world, so across a reset no index is processed twice or skipped.

    ``record_batch(batch_idx, batch_size)`` marks batch ``batch_idx`` of *every* rank's shard as
    processed, not only this rank's: data-parallel ranks take their batches in the same step, and
    so a survivor's committed state also knows what a lost rank had processed (a per-rank record
    would hand those samples out again after a failure).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []  # not processed yet, in this epoch's order (every rank's)
        self.indices: list[int] = []  # this rank's shard of remaining_indices
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def _world(self) -> tuple[int, int]:
        """(rank, size) to shard over: hora's world (tests override this to simulate other sizes)."""
        return basics.rank(), basics.size()

    def _epoch_order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a fresh order, nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (of ``batch_size`` samples per rank) of every rank's shard as processed.

        ``batch_idx`` counts from the last ``reset()`` (a ``DataLoader`` iterates the new shard from 0).
        Rank r's batch b holds positions r, r + size, ... of ``remaining_indices`` within
        [b * batch_size * size, (b + 1) * batch_size * size): together, that whole block.
        """
        width = batch_size * self.num_replicas
        self.record_indices(self.remaining_indices[batch_idx * width:(batch_idx + 1) * width])

    def record_indices(self, indices: list[int]) -> None:
        """Mark dataset ``indices`` as processed in this epoch (``TorchState.sync`` unites every rank's)."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch ``batch_idx`` (counted from the last ``reset()``)."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the indices processed in it (a copy)."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take ``state_dict``'s epoch and processed indices, then re-shard what remains over this world."""
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        self.reset()

    def reset(self) -> None:
        """Re-shard the indices of this epoch not processed yet over the current world."""
        self.rank, self.num_replicas = self._world()
        done = self.processed_indices
        self.remaining_indices = [i for i in self._epoch_order() if i not in done]
        self.indices = self.remaining_indices[self.rank::self.num_replicas]
        self.num_samples = len(self.indices)
        self.total_size = len(self.remaining_indices)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """How one stateful torch object is saved, restored and synced; it reads the object from the
    state's attribute each time, so ``state.model = other`` is followed."""

    def __init__(self, state: TorchState, name: str) -> None:
        self.state = state
        self.name = name
        self.saved: Any = None
        self.save()  # restore() before any commit goes back to the state at construction

    @property
    def value(self) -> Any:
        return getattr(self.state, self.name)

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # A deep copy each time: load_state_dict may keep the tensors it is given (an optimizer's
        # moments), which later steps update in place, and the commit must survive a second restore.
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0,
                                                    name=f"elastic.torch_state.{self.name}"))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


def _sharded(optimizer: Any) -> ZeroRedundancyOptimizer | None:
    """The ZeroRedundancyOptimizer behind ``optimizer`` (itself, or a sharded DistributedOptimizer's), or None."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    zero = optimizer.__dict__.get("_zero")
    return zero if isinstance(zero, ZeroRedundancyOptimizer) else None


class _ShardedOptimizerHandler(_Handler):
    """A sharded optimizer's state exists once, spread over the ranks (:mod:`hora.torch.zero_elastic`):
    a commit keeps this rank's shard and its predecessor's copy, and once the world is re-formed every
    rank reshards from what the survivors kept, at the sync, or (where the loop skips the sync after
    hosts were only removed) before the optimizer next moves anything."""

    def __init__(self, state: TorchState, name: str) -> None:
        self._first = True
        super().__init__(state, name)

    @property
    def zero(self) -> ZeroRedundancyOptimizer:
        zero = _sharded(self.value)
        assert zero is not None  # _handler_type chose this handler for a sharded optimizer
        return zero

    def save(self) -> None:
        # The first save is the state's construction, where a rank joining a running job stands alone.
        if self._first:
            self.saved = zero_elastic.snapshot(self.zero, initial=True)
            self.pending: zero_elastic.ShardSnapshot | None = None
            self._first = False
            return
        # Exchanged, then confirmed: the commit counts as made (and TorchState saves the rest) only
        # once every rank has its copies (see hora.torch.zero_elastic).
        self.pending = zero_elastic.snapshot(self.zero, after=self.saved)
        zero_elastic.confirm(self.zero)
        self.saved, self.pending = self.pending, None

    def _drop_pending_reductions(self) -> None:
        """Reductions of the step the world left (a DistributedOptimizer's): no world takes their results."""
        reset_step = getattr(self.value, "_reset_step", None)
        if reset_step is not None:
            reset_step()

    def restore(self) -> None:
        self._drop_pending_reductions()
        for group, saved in zip(self.value.param_groups, self.saved.hyperparameters):
            group.update(copy.deepcopy(saved))
        self.zero.defer_reshard(lambda: self._reshard(world_changed=True))

    def reset(self) -> None:
        self.zero.defer_reshard(lambda: self._reshard(world_changed=True))

    def sync(self) -> None:
        world_changed = self.zero.defer_reshard(None)
        self._drop_pending_reductions()
        # Rank 0's settings (a joining rank's are its script's first), as broadcast_optimizer_state gives them.
        settings = broadcast_object([hyperparameters(group) for group in self.value.param_groups], 0,
                                    name=f"elastic.torch_state.{self.name}.hyperparameters")
        for group, chosen in zip(self.value.param_groups, settings):
            group.update(chosen)
        self._reshard(world_changed)

    def _reshard(self, world_changed: bool) -> None:
        resharded, commit = zero_elastic.reshard(self.zero, self.saved, self.pending, world_changed)
        self.pending = None
        if resharded:
            # The copies now follow the new ring: a rank lost before the next commit is covered too.
            # Numbered as the commit it restored, so every rank (a joining one too) counts alike.
            self.saved = zero_elastic.snapshot(self.zero, commit=commit)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        # Indices recorded with record_indices are only this rank's: unite every rank's first.
        sampler = self.value
        everyone = allgather_object(sampler.processed_indices, name=f"elastic.torch_state.{self.name}.processed")
        state = sampler.state_dict()
        state["processed_indices"] = set().union(*everyone)
        sampler.load_state_dict(broadcast_object(state, 0, name=f"elastic.torch_state.{self.name}"))


def _scheduler_types() -> tuple[type, ...]:
    schedulers = torch.optim.lr_scheduler
    types = [getattr(schedulers, name) for name in ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau")
             if hasattr(schedulers, name)]
    return tuple(types)


def _handler_type(value: Any) -> type[_Handler] | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler
    if isinstance(value, torch.optim.Optimizer):
        return _ShardedOptimizerHandler if _sharded(value) is not None else _OptimizerHandler
    if isinstance(value, ElasticSampler):
        return _SamplerHandler
    if isinstance(value, _scheduler_types()):
        return _Handler
    return None


class TorchState(ObjectState):
    """The training state elastic ``run`` commits, restores and syncs, for PyTorch.

    ``model`` (any ``torch.nn.Module``), ``optimizer``, and keyword arguments that are LR schedulers
    or ``ElasticSampler``\\ s are kept through their ``state_dict()``: ``save()`` deep-copies it,
    ``restore()`` loads the copy back. ``sync()`` gives every rank rank 0's: parameters and buffers
    through ``broadcast_parameters``, the optimizer through ``broadcast_optimizer_state``, schedulers
    through ``broadcast_object``, and a sampler after uniting every rank's processed indices (then it
    re-shards the epoch's remainder over the new world). A sharded optimizer is kept as
    :mod:`hora.torch.zero_elastic` says: each commit keeps this rank's shard and a copy on the next
    rank, and the re-formed world reshards from what the survivors kept. Every other keyword
    argument is a picklable attribute kept by ``ObjectState``'s rules. All are read and assigned as attributes
    (``state.model``, ``state.epoch = 3``).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        values = {"model": model, "optimizer": optimizer, **kwargs}
        handled = {name: value for name, value in values.items() if _handler_type(value) is not None}
        plain = {name: value for name, value in values.items() if name not in handled}
        self._handlers: list[_Handler] = []
        for name, value in handled.items():
            setattr(self, name, value)
            handler_type = _handler_type(value)
            assert handler_type is not None  # what ``handled`` holds has one
            self._handlers.append(handler_type(self, name))
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **plain)

    def save(self) -> None:
        # A sharded optimizer's snapshot is collective and may fail: taken first, so that a commit that
        # fails there has saved nothing else either.
        for handler in sorted(self._handlers, key=lambda h: not isinstance(h, _ShardedOptimizerHandler)):
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers:
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers:
            handler.sync()
        super().sync()

    def reset(self) -> None:
        """Re-shard every sampler over the re-formed world. ``sync`` does it too, but a reset after
        hosts were only removed skips the sync, and a sampler left on its old shard would train some
        samples twice and skip others. Safe without a sync: every rank recorded the same batches."""
        for handler in self._handlers:
            if isinstance(handler.value, ElasticSampler):
                handler.value.reset()
            elif isinstance(handler, _ShardedOptimizerHandler):
                handler.reset()
