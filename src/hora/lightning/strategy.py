"""``HoraStrategy``: PyTorch Lightning's Trainer, data-parallel under ``hora run``.

Lightning 2.x dropped its ``HorovodStrategy``; this is hora's, written against
``lightning.pytorch``'s :class:`~lightning.pytorch.strategies.ParallelStrategy` API. It keeps
Horovod's model of a job: ``hora run -np N python train.py`` starts the N processes (Lightning
launches nothing), every process builds the same ``Trainer(strategy=HoraStrategy())`` and calls
``fit``, and then

- each optimizer becomes a :func:`hora.torch.DistributedOptimizer`, so gradients are averaged
  across ranks while the backward pass runs;
- rank 0's weights, buffers and optimizer hyper-parameters (and optimizer state, when there is any)
  are broadcast before the first step, so every replica starts equal;
- Lightning's automatic ``DistributedSampler`` gives each rank its own shard (``num_replicas`` is
  hora's size, ``rank`` hora's rank);
- ``self.log(..., sync_dist=True)`` values, ``all_gather``, ``broadcast`` and ``barrier`` go through
  hora's collectives.

The learning rate is not scaled by the number of workers (Lightning 1.x's HorovodStrategy multiplied
it by the world size itself): scale it in ``configure_optimizers`` as a Horovod script does
(``lr * hvd.size()``), or leave it, when the global batch should stay the same.

Outside ``hora run`` the strategy still works: ``hora.init()`` then forms a private one-process
job, so the same script trains on one process unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

import hora.torch as hvd
from hora import basics, config
from hora.basics import ProcessSet, global_process_set
from hora.torch.compression import Compression
from hora.torch.optimizer import _DistributedOptimizer

logger = logging.getLogger(__name__)

__all__ = ["HoraEnvironment", "HoraStrategy", "HoraSyncBatchNorm"]


def _ensure_initialised() -> None:
    """``hora.init()`` unless this process already joined its job (a second call is a no-op, but
    the check keeps the hot getters free of the init lock)."""
    if not basics.is_initialized():
        hvd.init()


class HoraEnvironment(ClusterEnvironment):
    """Lightning's view of a hora job: ranks and sizes are hora's, and hora (not Lightning) created
    the processes.

    Lightning asks its cluster environment for the world size and ranks before the strategy sets
    anything up, so the getters join the job (``hora.init()``) on first use. hora's coordinates are
    fixed by ``hora run``: the setters only check that Lightning agrees.
    """

    @property
    def creates_processes_externally(self) -> bool:
        """True: ``hora run`` (or ``hora.run``/``hora.spark.run``) started every worker."""
        return True

    @property
    def main_address(self) -> str:
        """The job's rendezvous address. Nothing here uses ``torch.distributed``; this is informational."""
        return str(config.get("rendezvous_addr") or "127.0.0.1")

    @property
    def main_port(self) -> int:
        """The job's rendezvous port (0 outside ``hora run``); informational, as :attr:`main_address`."""
        return int(config.get("rendezvous_port") or 0)

    @staticmethod
    def detect() -> bool:
        """Whether this process was started by ``hora run`` (its identity variables are set)."""
        return config.is_set("rank") and config.is_set("size")

    def world_size(self) -> int:
        _ensure_initialised()
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        if size != self.world_size():
            logger.warning("Lightning asked for world size %d; hora's job has %d processes and keeps them",
                           size, self.world_size())

    def global_rank(self) -> int:
        _ensure_initialised()
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != self.global_rank():
            logger.warning("Lightning asked for global rank %d; hora gave this process rank %d and keeps it",
                           rank, self.global_rank())

    def local_rank(self) -> int:
        _ensure_initialised()
        return hvd.local_rank()

    def node_rank(self) -> int:
        _ensure_initialised()
        return hvd.cross_rank()


class HoraSyncBatchNorm(LayerSync):
    """``Trainer(sync_batchnorm=True)`` for hora: batch-norm layers become
    :class:`hora.torch.SyncBatchNorm`, whose statistics cover the global batch.

    Lightning's own plugin converts to ``torch.nn.SyncBatchNorm``, which needs a
    ``torch.distributed`` process group that a hora job does not have; :class:`HoraStrategy` swaps
    it for this one. The converted layers keep the original ``Parameter`` and buffer objects, so
    optimizers built before or after the conversion see the same tensors.
    """

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._swap(model, self._to_sync)

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._swap(model, self._from_sync)

    @classmethod
    def _swap(cls, module: torch.nn.Module, convert: Callable[[torch.nn.Module], torch.nn.Module | None]
              ) -> torch.nn.Module:
        replaced = convert(module)
        if replaced is not None:
            return replaced
        for name, child in module.named_children():
            new = cls._swap(child, convert)
            if new is not child:
                module.add_module(name, new)
        return module

    @staticmethod
    def _move_state(old: _BatchNorm, new: _BatchNorm) -> _BatchNorm:
        new.weight, new.bias = old.weight, old.bias
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(new, buffer, getattr(old, buffer))
        new.train(old.training)
        return new

    @classmethod
    def _to_sync(cls, module: torch.nn.Module) -> torch.nn.Module | None:
        if not isinstance(module, _BatchNorm) or isinstance(module, (hvd.SyncBatchNorm, LazyModuleMixin)):
            return None
        new = hvd.SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                module.track_running_stats)
        new._hora_original_class = type(module)
        return cls._move_state(module, new)

    @classmethod
    def _from_sync(cls, module: torch.nn.Module) -> torch.nn.Module | None:
        original = getattr(module, "_hora_original_class", None)
        if not isinstance(module, hvd.SyncBatchNorm) or original is None:
            return None
        new = original(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        return cls._move_state(module, new)


_OPS = (("avg", hvd.Average), ("mean", hvd.Average), ("sum", hvd.Sum), ("max", hvd.Max), ("min", hvd.Min),
        ("product", hvd.Product), ("prod", hvd.Product))


def _hora_op(reduce_op: Any) -> int:
    """hora's reduce op for Lightning's spelling: None (mean), a string, or a ``ReduceOp``."""
    if reduce_op is None:
        return hvd.Average
    if isinstance(reduce_op, str):
        for name, op in _OPS:
            if reduce_op.lower() == name:
                return op
        raise ValueError(f"HoraStrategy.reduce: unsupported reduce_op {reduce_op!r}; "
                         "use 'mean', 'sum', 'max', 'min' or 'product'")
    for name, op in _OPS:
        member = getattr(ReduceOp, name.upper(), None)
        if member is not None and reduce_op == member:
            return op
    raise ValueError(f"HoraStrategy.reduce: unsupported reduce_op {reduce_op!r}; "
                     "hora reduces with mean (AVG), SUM, MAX, MIN or PRODUCT")


def _unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class HoraStrategy(ParallelStrategy):
    """Data-parallel training across the processes of a hora job (``hora run -np N``).

    ``Trainer(strategy=HoraStrategy())``, or ``Trainer(strategy="hora")`` after
    ``import hora.lightning``. Each process drives one device: the CPU, or on CUDA the GPU of its
    local rank. The keyword arguments are :func:`hora.torch.DistributedOptimizer`'s and apply to
    every optimizer ``configure_optimizers`` returns; ``backward_passes_per_step`` defaults to the
    Trainer's ``accumulate_grad_batches``, so gradient accumulation reduces once per optimizer step.
    """

    strategy_name = "hora"

    # Lightning's own attributes, which this class assigns (declared for type checkers only).
    model: Any
    optimizers: Any
    _layer_sync: Any

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        *,
        compression: Any = Compression.none,
        op: int = hvd.Average,
        gradient_predivide_factor: float = 1.0,
        backward_passes_per_step: int | None = None,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment or HoraEnvironment(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._optimizer_kwargs = dict(compression=compression, op=op,
                                      gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                                      groups=groups, sparse_as_dense=sparse_as_dense)
        self._backward_passes_per_step = backward_passes_per_step

    # ---- where this process stands ----------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        """The CPU, or on CUDA the GPU of this process's local rank (Horovod's one-GPU-per-process rule)."""
        devices = self.parallel_devices
        if devices and devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
        return devices[0] if devices else torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """True: Lightning then syncs ``sync_dist`` logs and injects a ``DistributedSampler``, on one
        process too (a sampler of one replica), so one script behaves the same at every size."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One shard per hora rank (the base class would count this process's devices instead)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Join the hora job when the Trainer is built, so ``trainer.global_rank`` and Lightning's
        ``rank_zero_only`` (which silences progress bars and prints on the other ranks) are right
        from the start."""
        devices = self.parallel_devices
        if devices and len(devices) > 1 and devices[0].type != "cuda":
            raise MisconfigurationException(
                f"HoraStrategy drives one device per process, but the Trainer was given {len(devices)} "
                f"{devices[0].type} devices. `hora run -np N` starts the processes: pass devices=1 (or 'auto').")
        _ensure_initialised()
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        """Join the job (if not yet joined), then let the accelerator claim this process's device."""
        _ensure_initialised()
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        super().setup_environment()

    # ---- model and optimizers ---------------------------------------------------------------------

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        """Move the model to its device, broadcast rank 0's weights, and (when fitting) wrap each
        optimizer in a DistributedOptimizer and broadcast rank 0's optimizer hyper-parameters/state."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        assert self.model is not None
        if fitting and self._layer_sync is not None:
            if isinstance(self._layer_sync, TorchSyncBatchNorm):
                # torch.nn.SyncBatchNorm needs torch.distributed, which a hora job does not set up.
                self._layer_sync = HoraSyncBatchNorm()
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        assert self.lightning_module is not None
        # Every replica starts from rank 0's weights and buffers, whether it trains or only evaluates.
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._distribute_optimizers(trainer)

    def _distribute_optimizers(self, trainer: pl.Trainer) -> None:
        passes = self._backward_passes_per_step
        if passes is None:
            # Lightning runs accumulate_grad_batches backward passes per optimizer step; the hooks
            # then reduce once, on the last of them.
            passes = trainer.accumulate_grad_batches if self.lightning_module.automatic_optimization else 1
        named = list(self.lightning_module.named_parameters())
        wrapped = []
        for index, optimizer in enumerate(self.optimizers):
            optimizer = _unwrap(optimizer)
            if not isinstance(optimizer, _DistributedOptimizer):
                distributed = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                                       backward_passes_per_step=passes, **self._optimizer_kwargs)
                # LR schedulers keep a reference to the optimizer they were built on; point them at
                # the wrapper (both share param_groups and state, so nothing else changes).
                schedulers = [scheduler_config.scheduler for scheduler_config in self.lr_scheduler_configs
                              if getattr(scheduler_config.scheduler, "optimizer", None) is optimizer]
                for scheduler in schedulers:
                    scheduler.optimizer = distributed
                if schedulers:
                    _track_steps_for_schedulers(distributed)
                optimizer = distributed
            _broadcast_optimizer(optimizer, index)
            wrapped.append(optimizer)
        self.optimizers = wrapped

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow a changing ``accumulate_grad_batches`` (``GradientAccumulationScheduler`` sets it
        at the start of an epoch, when no accumulation is part-way): the DistributedOptimizers must
        reduce after as many backward passes as Lightning runs before each step."""
        module = self.lightning_module
        if self._backward_passes_per_step is not None or module is None or not module.automatic_optimization:
            return
        passes = module.trainer.accumulate_grad_batches
        for optimizer in self.optimizers:
            hora_optimizer = _unwrap(optimizer)
            if isinstance(hora_optimizer, _DistributedOptimizer) and hora_optimizer.backward_passes_per_step != passes:
                hora_optimizer.set_backward_passes_per_step(passes)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Let the optimizer run Lightning's closure (training step and backward), average the
        gradients right after it, then step on the averages.

        Lightning's precision plugin wraps the closure so that ``on_before_optimizer_step`` and
        gradient clipping run inside it, right after backward; a DistributedOptimizer's own
        ``step(closure)`` averages only when the closure returns, so those hooks would see local
        gradients. Here the reduction happens inside the closure, ahead of them, and the step
        itself skips it.
        """
        hora_optimizer = _unwrap(optimizer)
        if not isinstance(hora_optimizer, _DistributedOptimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_average() -> Any:
            result = closure()
            hora_optimizer.synchronize()
            return result

        with hora_optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    # ---- collectives ------------------------------------------------------------------------------

    @staticmethod
    def _set_for(group: Any) -> ProcessSet:
        """A hora ProcessSet passed as Lightning's ``group`` narrows a collective to it; anything
        else (None, a torch process group) means every rank."""
        return group if isinstance(group, ProcessSet) else global_process_set

    def reduce(self, tensor: Tensor | Any, group: Any = None, reduce_op: Any = "mean") -> Tensor | Any:
        """``tensor`` reduced over the ranks (mean by default; 'sum', 'max', 'min', 'product'), as
        ``sync_dist=True`` logging needs. Non-tensors come back unchanged, as with DDP. The mean of an
        integer tensor is returned in floating point instead of being truncated."""
        if not isinstance(tensor, Tensor):
            return tensor
        op = _hora_op(reduce_op)
        process_set = self._set_for(group)
        if process_set.size() == 1:
            return tensor
        if op == hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            total = hvd.allreduce(tensor.detach(), op=hvd.Sum, process_set=process_set)
            return total.to(torch.get_default_dtype()) / process_set.size()
        return hvd.allreduce(tensor.detach(), op=op, process_set=process_set)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension (world size first, as DDP's)."""
        stacked = tensor.contiguous().unsqueeze(0)
        with contextlib.nullcontext() if sync_grads else torch.no_grad():
            return hvd.allgather(stacked, process_set=self._set_for(group))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable object on every rank (checkpoint paths, early-stopping decisions)."""
        return hvd.broadcast_object(obj, root_rank=src, process_set=global_process_set)

    def barrier(self, name: str | None = None) -> None:
        hvd.barrier(process_set=global_process_set)

    # ---- end --------------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Detach the gradient hooks of this fit's DistributedOptimizers and restore converted layers.

        The hooks live on the parameters: left there, a second ``fit`` on the same model would reduce
        every gradient twice under one name. hora itself stays initialised, as after a Horovod script's
        training loop: the script may still evaluate, save or run collectives.
        """
        for optimizer in self.optimizers:
            for hook in getattr(_unwrap(optimizer), "_hooks", ()):
                hook.remove()
        module = self.lightning_module
        if (self._layer_sync is not None and module is not None and module._trainer is not None
                and module._trainer.state.fn == TrainerFn.FITTING):
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Make ``Trainer(strategy="hora")`` build a HoraStrategy."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="Data-parallel training over a hora job (hora run -np N)")


def _track_steps_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way torch's LR schedulers mark the step of the optimizer they are
    built on, so that they see the wrapper's steps.

    A scheduler checks, on its first ``step()``, that its optimizer's ``step`` still carries its
    marker and has run; the DistributedOptimizer is a new object whose ``step`` carries none, and
    every scheduler would warn that ``optimizer.step()`` was overridden. The marked function calls
    the wrapper's own ``step`` (the one that averages gradients). The two names are torch's
    (``_wrapped_by_lr_sched``, ``_opt_called``); if torch renames them, the warning comes back and
    nothing else changes.
    """
    step = type(optimizer).step
    ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        live = ref()
        assert live is not None  # the function is the optimizer's own ``step`` attribute
        live._opt_called = True
        return step(live, *args, **kwargs)

    tracked_step.__dict__["_wrapped_by_lr_sched"] = True  # a function attribute (torch's marker)
    optimizer.step = tracked_step


def _broadcast_optimizer(optimizer: torch.optim.Optimizer, index: int) -> None:
    """Give every rank rank 0's optimizer hyper-parameters, and its state when any rank has some.

    A fresh optimizer has no state anywhere: then only the hyper-parameters travel. Going through
    :func:`hora.torch.broadcast_optimizer_state` anyway would first create the state by a step on
    zero gradients, which advances Adam's step count and so changes its bias correction; a job
    would then no longer match the same training on one process. State restored before the fit (on
    any rank) is broadcast whole.
    """
    has_state = torch.tensor([int(any(bool(s) for s in optimizer.state.values()))])
    if hvd.allreduce(has_state, op=hvd.Max, name=f"hora.lightning.optimizer.{index}.has_state").item():
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    groups = hvd.broadcast_object(groups, root_rank=0, name=f"hora.lightning.optimizer.{index}.param_groups")
    for group, values in zip(optimizer.param_groups, groups):
        group.update(values)
