"""DistributedOptimizer: averages gradients across ranks while the backward pass is still running.

A hook on every parameter fires as soon as its gradient has been accumulated and starts an in-place
asynchronous allreduce of it, so communication overlaps the rest of the backward pass. ``step()``
waits for whatever is still in flight, then lets the wrapped optimizer update the weights.

``DistributedOptimizer(op=hvd.Adasum)`` is Horovod's Adasum optimizer (in this module, as in Horovod),
which reduces weight updates, not gradients. Adasum needs the full magnitude of what it combines, and
a gradient is not yet an update (momentum, Adam's scaling). So, as in Horovod, every rank first takes
a *local* step of the wrapped optimizer on its own gradients, the difference between the weights after
and before (the delta) is combined across ranks with Adasum, and every rank sets its weights to the
starting weights plus the combined delta. Each rank's optimizer state (momentum, Adam's moments)
stays its own, as in Horovod.

Differences from Horovod, written down in docs/transports-and-tuning.md: Horovod starts each
parameter's local step and delta reduction from the backward hook, once its gradient is ready; here the
local step runs in ``step()`` and the deltas are submitted together (the engine fuses them), so the
reduction does not overlap the backward pass. ``synchronize()`` has nothing to wait for.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hora import basics, collectives, gradient_buckets, horovod_args
from hora.basics import Adasum, Average, ProcessSet, global_process_set
from hora.errors import HoraError
from hora.horovod_args import GradientReduction
from hora.torch import mpi_ops
from hora.torch.compression import Compression


class _Pending:
    """One in-flight reduction: the handle and how to land its result in the gradients."""

    __slots__ = ("handle", "finish")

    def __init__(self, handle: mpi_ops.TorchHandle, finish) -> None:
        self.handle = handle
        self.finish = finish


if TYPE_CHECKING:  # the class is mixed in before the wrapped optimizer's own (see DistributedOptimizer)
    from torch.optim import Optimizer as _OptimizerBase
else:
    _OptimizerBase = object


class _DistributedOptimizer(_OptimizerBase):
    """Mixed in before the wrapped optimizer's own class (see :func:`DistributedOptimizer`).

    Its methods reach the wrapped class with ``super()``, which follows the instance's MRO: a class
    derived from the wrapped one (a library patching ``step``) still ends in the wrapped optimizer's
    own ``step``, once.
    """

    def _hora_setup(self, named_parameters, compression, backward_passes_per_step: int,
                    reduction: GradientReduction, groups, sparse_as_dense: bool) -> None:
        process_set = reduction.process_set
        self._compression = compression
        self._reduction = reduction
        self._op = reduction.op
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        # A rank outside the process set takes no part: no hooks, and synchronize() has nothing to do.
        self._excluded = not process_set.included()
        self._should_synchronize = True
        self._synchronized = False
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._names = self._parameter_names(named_parameters, all_params)
        self._requires_update = [p for p in all_params if p.requires_grad]
        if isinstance(groups, int) and not self._excluded:
            self._requires_update = self._in_reference_order(self._requires_update)
        self._groups = self._make_groups(groups)
        self._group_of = {p: i for i, g in enumerate(self._groups) for p in g}
        # Without explicit groups, gradients travel in buckets: one flat tensor per bucket, one
        # engine submission each (the engine's cost is per submission, not per byte).
        self._buckets = self._make_buckets() if groups is None else []
        self._group_of.update({p: ("bucket", i) for i, b in enumerate(self._buckets) for p in b})
        self._pending: dict[Any, _Pending] = {}  # parameter, or group index -> in-flight reduction
        self._ready_in_group: dict[int, set] = {}
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._delay = {p: self.backward_passes_per_step for p in self._requires_update}
        self._hooks = [] if self._excluded else [
            p.register_post_accumulate_grad_hook(_weak_hook(self)) for p in self._requires_update]
        # The hooks live on the parameters, which outlive this optimizer when a script wraps a new
        # one over the same model: they hold it weakly and go away with it.
        weakref.finalize(self, _remove_hooks, self._hooks)

    # ---- setup helpers -------------------------------------------------------------------------

    @staticmethod
    def _parameter_names(named_parameters, all_params: list) -> dict:
        if named_parameters is None:
            return {p: f"allreduce.noname.{i}" for i, p in enumerate(all_params)}
        pairs = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
            raise ValueError("named_parameters must be a sequence of (name, parameter) pairs, "
                             "e.g. model.named_parameters()")
        names = [name for name, _ in pairs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"parameter names in named_parameters must be unique; repeated: {duplicates}")
        by_param = {p: f"allreduce.{name}" for name, p in pairs}
        unnamed = [i for i, p in enumerate(all_params) if p not in by_param]
        if unnamed:
            raise ValueError(f"named_parameters lacks {len(unnamed)} of the optimizer's parameters "
                             f"(positions {unnamed[:10]}); pass model.named_parameters() of the same model")
        return by_param

    def _in_reference_order(self, params: list) -> list:
        """``params`` in the order the process set's first rank lists them (by name).

        Groups are consecutive runs of this list, named after their first member, so every rank
        must cut the same list: one whose model registers its parameters in another order would
        otherwise reduce different tensors under one group name, or wait on names no peer submits.
        Every rank gathers every rank's names, so a rank whose parameters differ raises on all ranks
        alike instead of leaving the others waiting.
        """
        names = [self._names[p] for p in params]
        every = collectives.allgather_object(names, process_set=self._process_set)
        for other in every[1:]:
            horovod_args.order_as_reference(other, every[0])  # the same error on every rank
        order = horovod_args.order_as_reference(names, every[0])
        return [params[i] for i in order]

    def _make_groups(self, groups) -> list[list]:
        if groups is None:
            return []
        params = self._requires_update
        if isinstance(groups, int):
            return horovod_args.split_evenly(params, groups)
        return [[params[i] for i in group] for group in horovod_args.listed_groups(groups, params) if group]

    def _make_buckets(self) -> list[list]:
        """Consecutive parameters in reverse registration order (about the order backward produces
        their gradients), planned by :mod:`hora.gradient_buckets` (the rule every binding shares)."""
        cap = gradient_buckets.bucket_bytes()
        if self._excluded or not gradient_buckets.bucketable(self._op, self._compression):
            return []
        params = list(reversed(self._requires_update))
        sizes = [(p.numel() * p.element_size(), p.dtype) for p in params]
        return [[params[i] for i in bucket] for bucket in gradient_buckets.plan(sizes, cap)]

    # ---- hooks and reductions -------------------------------------------------------------------

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if p not in self._delay:
            return
        key = self._group_of.get(p, p)
        if key in self._pending or p in self._pending:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        if key is p:
            self._start(p)
            return
        ready = self._ready_in_group.setdefault(key, set())
        ready.add(p)
        if isinstance(key, int):
            if len(ready) == len(self._groups[key]):
                self._start_group(key)
        elif len(ready) == len(self._buckets[key[1]]):
            self._start_bucket(key)

    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            # Not used in this step on this rank: contribute zeros so every rank reduces the same set.
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse and self._sparse_as_dense:
            return p.grad.to_dense()  # reduced dense; _land turns the result back into a sparse gradient
        return p.grad

    @staticmethod
    def _land(p: torch.Tensor, reduced: torch.Tensor) -> None:
        """Put a reduced gradient into ``p.grad``: in place, or (sparse_as_dense) back in sparse form,
        as Horovod does, so optimizers that need sparse gradients (SparseAdam) still get them."""
        if p.grad.is_sparse:
            p.grad = reduced.to_sparse(p.grad.sparse_dim())
        else:
            with torch.no_grad():
                p.grad.copy_(reduced)

    def _start(self, p: torch.Tensor) -> None:
        grad = self._dense_grad(p)
        name = self._names[p]
        if grad.is_sparse:
            sparse_handle = mpi_ops.sparse_allreduce_async(grad, name, self._op, self._process_set)

            def finish_sparse(result, p=p):
                p.grad = result
            self._pending[p] = _Pending(sparse_handle, finish_sparse)
            return
        compressed, ctx = self._compression.compress(grad)
        r = self._reduction
        handle = mpi_ops.allreduce_async_(compressed, name=name, op=r.op, prescale_factor=r.prescale_factor,
                                          postscale_factor=r.postscale_factor, process_set=r.process_set)

        def finish(result, p=p, ctx=ctx, compressed=compressed):
            if compressed is not p.grad:
                self._land(p, self._compression.decompress(result, ctx))
        self._pending[p] = _Pending(handle, finish)

    def _start_group(self, index: int) -> None:
        params = self._groups[index]
        grads = [self._dense_grad(p) for p in params]
        if any(g.is_sparse for g in grads):
            raise ValueError("grouped allreduce does not take sparse gradients; pass sparse_as_dense=True")
        pairs = [self._compression.compress(g) for g in grads]
        r = self._reduction
        # Named after its first parameter, as Horovod does: two optimizers in one process (with
        # different named_parameters) then never share a name for groups of different shapes.
        handle = mpi_ops.grouped_allreduce_async_([c for c, _ in pairs], name=self._names[params[0]], op=r.op,
                                                  prescale_factor=r.prescale_factor,
                                                  postscale_factor=r.postscale_factor, process_set=r.process_set)

        def finish(results, params=params, pairs=pairs):
            for p, result, (compressed, ctx) in zip(params, results, pairs):
                if compressed is not p.grad:
                    self._land(p, self._compression.decompress(result, ctx))
        self._pending[index] = _Pending(handle, finish)

    def _start_bucket(self, key: tuple) -> None:
        params = self._buckets[key[1]]
        grads = [self._dense_grad(p) for p in params]
        if any(g.is_sparse for g in grads) or any(g is not p.grad for g, p in zip(grads, params)):
            # Sparse gradients (or sparse ones made dense) have their own path: per tensor.
            for p in params:
                self._start(p)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        compressed, ctx = self._compression.compress(flat)
        r = self._reduction
        handle = mpi_ops.allreduce_async_(compressed, name=f"{self._names[params[0]]}.bucket{len(params)}",
                                          op=r.op, prescale_factor=r.prescale_factor,
                                          postscale_factor=r.postscale_factor, process_set=r.process_set)

        def finish(result, grads=grads, ctx=ctx):
            reduced = self._compression.decompress(result, ctx)
            pieces = torch.split(reduced, [g.numel() for g in grads])
            with torch.no_grad():
                torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(pieces, grads)])
        self._pending[key] = _Pending(handle, finish)

    # ---- the optimizer interface ----------------------------------------------------------------

    def synchronize(self) -> None:
        """Finish every reduction of this step, starting those whose hooks did not fire."""
        if self._excluded:
            self._synchronized = True
            return
        for p in self._requires_update:
            key = self._group_of.get(p, p)
            if key in self._pending or p in self._pending:  # (a bucket of sparse gradients: per tensor)
                continue
            if isinstance(key, int):
                self._start_group(key)
            elif key is p:
                self._start(p)
            else:
                self._start_bucket(key)
        for pending in self._pending.values():
            pending.finish(mpi_ops.synchronize(pending.handle))
        self._pending.clear()
        self._ready_in_group.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Average the gradients, then step.

        With a ``closure`` (the loss and its backward pass), the closure runs first and its gradients
        are then averaged; Horovod averages before calling it, so its step uses the previous pass's
        averages and leaves the closure's own gradients unaveraged. Each closure call the wrapped
        optimizer makes (L-BFGS makes several) averages that call's gradients, and a scalar tensor
        loss is averaged too, so that every rank's optimizer takes the same decisions from it.
        """
        if not self._should_synchronize:
            self._synchronized = False
            return super().step(closure)
        if closure is not None:
            return self._step_with_closure(closure)
        if self._synchronized:
            # The text begins as Horovod's does: scripts filter this warning by it.
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(): every gradient is reduced a second time. Wrap step() in "
                          "`with optimizer.skip_synchronize():` after an explicit synchronize().", stacklevel=2)
        self.synchronize()
        self._synchronized = False
        return super().step()

    def _step_with_closure(self, closure):
        def averaged_closure():
            with torch.enable_grad():
                loss = closure()
            self.synchronize()
            if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not self._excluded:
                name = f"{self._names[self._requires_update[0]]}.closure_loss" if self._requires_update else \
                    "DistributedOptimizer.closure_loss"
                loss = mpi_ops.allreduce(loss.detach(), name=name, op=Average,
                                         process_set=self._reduction.process_set)
            return loss

        self._synchronized = False
        return super().step(averaged_closure)

    def zero_grad(self, set_to_none: bool = True):
        # Pending reductions, or gradients of a step part-way through local accumulation (the
        # reductions start on the last of backward_passes_per_step passes): both would be lost.
        if self._pending or any(d != self.backward_passes_per_step for d in self._delay.values()):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict) -> None:
        """Load optimizer state, and start the next step afresh, as Horovod does: reductions still in
        flight are finished and dropped (their results belong to the state being replaced, and their
        names must be free for the next step), and every parameter waits for
        ``backward_passes_per_step`` new passes again."""
        self._reset_step()
        return super().load_state_dict(state_dict)

    def _reset_step(self) -> None:
        for pending in self._pending.values():
            try:
                mpi_ops.synchronize(pending.handle)
            except HoraError:
                pass  # the job is failing (elastic restore): nothing of that step is kept anyway
        self._pending.clear()
        self._ready_in_group.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = horovod_args.backward_passes(passes)
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step


def _weak_hook(optimizer: _DistributedOptimizer):
    ref = weakref.ref(optimizer)

    def on_grad_ready(p: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live._on_grad_ready(p)
    return on_grad_ready


def _remove_hooks(hooks: list) -> None:
    for hook in hooks:
        hook.remove()



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


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged across all ranks.

    The result is an instance of the wrapped optimizer's own class (``isinstance`` checks and
    learning-rate schedulers keep working) sharing its parameter groups, state and hyper-parameters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a hora DistributedOptimizer: wrapping it again would reduce "
                         "every gradient twice; wrap the original optimizer once")
    groups = horovod_args.resolve_groups(num_groups, groups)
    passes = horovod_args.backward_passes(backward_passes_per_step)
    reduction = GradientReduction.create(op, gradient_predivide_factor, process_set)
    compression = horovod_args.check_compression(compression)
    basics.engine()  # fail early, with the init() message, when hora is not initialised
    base = optimizer.__class__
    mixin = _DistributedOptimizer
    if reduction.op == Adasum:  # Horovod's Adasum optimizer: the deltas of a local step are reduced
        mixin = _DistributedAdasumOptimizer
    cls: type[object] = type(base.__name__, (mixin, base),
                             {"__module__": base.__module__, "__qualname__": base.__qualname__})
    wrapped: Any = cls.__new__(cls)
    # Leave behind instance attributes that would shadow the wrapper's methods: an LR scheduler built
    # on the plain optimizer replaces its ``step`` with a bound wrapper that would skip the allreduce.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if k not in _DistributedOptimizer.__dict__})
    wrapped._hora_setup(named_parameters, compression, passes, reduction, groups, sparse_as_dense)
    return wrapped
