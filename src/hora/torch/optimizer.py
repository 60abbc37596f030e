"""DistributedOptimizer: averages gradients across ranks while the backward pass is still running.

A hook on every parameter fires as soon as its gradient has been accumulated and starts an in-place
asynchronous allreduce of it, so communication overlaps the rest of the backward pass. ``step()``
waits for whatever is still in flight, then lets the wrapped optimizer update the weights.

Gradients travel in buckets (one request each; :mod:`hora.binding.gradient_buckets` plans them), and each
bucket owns a flat buffer of which its parameters' ``.grad`` are views, as with PyTorch DDP's
``gradient_as_bucket_view``: the allreduce runs in place on the buffer, so nothing is flattened in the
hooks or copied back at ``synchronize()`` while the gradients stay views (:class:`_BucketBuffer`).

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
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hora import basics, collectives, horovod_args
from hora.basics import Adasum, Average, ProcessSet, global_process_set
from hora.binding import gradient_buckets
from hora.binding.handle import completed
from hora.compression import PowerSGDSpec, StatefulCompressionSpec, TopKSpec
from hora.errors import HoraError
from hora.horovod_args import GradientReduction
from hora.torch import mpi_ops, sharded_join
from hora.torch.comm_hooks import GradBucket
from hora.torch.compression import Compression
from hora.torch.gradient_shards import (
    COMPRESSIONS as _SHARDED_GRADIENT_COMPRESSIONS,
    GradientShards,
    clip_grad_norm_ as _clip_sharded_grad_norm_,
)
from hora.torch.powersgd import PowerSGDReducer
from hora.torch.step_reducer import StepReducer
from hora.torch.topk import TopKReducer
from hora.torch.zero import ZeroRedundancyOptimizer


class _Pending:
    """One in-flight reduction: the handle and how to land its result in the gradients."""

    __slots__ = ("handle", "finish")

    def __init__(self, handle: Any, finish) -> None:  # a TorchHandle, or a comm hook's future
        self.handle = handle
        self.finish = finish


# Slots in a bucket's buffer start at multiples of this many bytes: CUDA's multi-tensor kernels (the
# optimizers' foreach paths) vectorise only over 16-byte aligned tensors. The padding stays zero.
_SLOT_ALIGN_BYTES = 16


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _gradient_strides(p: torch.Tensor) -> tuple[int, ...]:
    """The strides autograd gives ``p``'s gradient (its gradient layout contract), so that a view
    stands in for the gradient autograd would make: ``p``'s own where ``p`` covers its memory densely
    without overlap (a channels_last weight keeps channels_last), row-major otherwise."""
    if p.numel() == 0:
        return _row_major(p.shape)
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(p.shape, p.stride()) if sz != 1):
        if stride != expected:
            return _row_major(p.shape)
        expected *= size
    return tuple(p.stride())


def _layout_tag(slots: Sequence[tuple[torch.Size, tuple[int, ...], int]]) -> str:
    """A suffix for the bucket's request name: empty where every slot holds its gradient in row-major
    order, else a digest of the orders. Ranks whose parameters differ in memory layout (channels_last
    on one rank only) would sum mismatched elements under one name; with this they submit different
    names, which the engine reports, instead of a wrong sum."""
    def order(shape: torch.Size, strides: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(st for size, st in zip(shape, strides) if size != 1)  # size-1 dims order nothing

    orders = [order(shape, strides) for shape, strides, _ in slots]
    if orders == [order(shape, _row_major(shape)) for shape, _, _ in slots]:
        return ""
    return f".strided{zlib.crc32(repr(orders).encode()):08x}"


class _BucketBuffer:
    """A bucket's persistent flat gradient buffer; each parameter's ``.grad`` is a view of its slice.

    The allreduce then runs in place on the buffer and lands in the gradients with nothing to copy
    back, and while the gradients stay views (``zero_grad(set_to_none=False)`` zeroes them in place,
    autograd adds to them in place) nothing is copied in either. A gradient that is not its view (the
    first step, a new one after ``zero_grad()``'s ``None``, a ``.grad`` the user assigned) is copied
    into its slice once and replaced by the view. The buffer is cut on the bucket's first reduction,
    from the parameters as they are then, and again when a parameter's storage changes
    (``model.double()``, ``model.to(device)``).
    """

    __slots__ = ("params", "flat", "views", "addresses", "param_addresses", "layout", "tag")

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.addresses: list[int] = []  # each view's data_ptr: gradients found there are in place
        self.param_addresses: list[int] = []  # the parameters' data_ptr when the buffer was cut
        self.layout: tuple | None = None  # (dtype, device, ((shape, strides, offset), ...))
        self.tag = ""  # see _layout_tag

    def gradients(self) -> torch.Tensor | None:
        """The buffer with every gradient in place (a missing one as zeros), or None where a view
        cannot stand in: a sparse gradient, one that records a graph (``create_graph=True``),
        parameters of mixed dtypes or devices. The caller then copies, as without views."""
        if self.flat is not None:
            try:  # the steady state, checked by address: ``grad.data = ...`` keeps the tensor object
                if [p.grad.data_ptr() for p in self.params] == self.addresses:
                    return self.flat
            except (AttributeError, RuntimeError):  # a gradient is None, or has no storage (sparse)
                pass
        return self._adopt()

    def _adopt(self) -> torch.Tensor | None:
        grads = [p.grad for p in self.params]
        if any(g is not None and (g.layout != torch.strided or g.requires_grad) for g in grads):
            return None
        if self.flat is None or [p.data_ptr() for p in self.params] != self.param_addresses:
            if not self._cut():
                return None
        sources, targets, missing = [], [], []
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is not None and g.data_ptr() == self.addresses[i]:
                continue
            view = self.views[i]
            if view.data_ptr() != self.addresses[i]:  # re-pointed by ``grad.data = ...``: make a new one
                view = self.views[i] = self._view(i)
            if g is None:
                missing.append(view)  # not used on this rank this step: it contributes zeros
            else:
                sources.append(g)
                targets.append(view)
            p.grad = view
        with torch.no_grad():
            if sources:
                torch._foreach_copy_(targets, sources)
            if missing:
                torch._foreach_zero_(missing)
        return self.flat

    def _cut(self) -> bool:
        """(Re)cut the buffer from the parameters as they are now; False where they cannot share one."""
        params = self.params
        dtype, device = params[0].dtype, params[0].device
        if any(p.dtype != dtype or p.device != device or p.layout != torch.strided for p in params):
            self.flat, self.layout = None, None
            return False
        self.param_addresses = [p.data_ptr() for p in params]
        align = max(1, _SLOT_ALIGN_BYTES // params[0].element_size())
        slots, total = [], 0
        for p in params:
            slots.append((p.shape, _gradient_strides(p), total))
            total += -(-p.numel() // align) * align
        layout = (dtype, device, tuple(slots))
        if layout == self.layout:  # new parameter storage of the same shapes: the buffer still fits
            return True
        self.layout, self.tag = layout, _layout_tag(slots)
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        self.views = [self._view(i) for i in range(len(params))]
        self.addresses = [v.data_ptr() for v in self.views]
        return True

    def _view(self, index: int) -> torch.Tensor:
        assert self.flat is not None and self.layout is not None
        shape, strides, offset = self.layout[2][index]
        return self.flat.as_strided(shape, strides, offset)


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
        #: each parameter's own name (the user's, or ``noname.<position>``); its requests are named
        #: ``allreduce.<name>``, as Horovod names them.
        self._plain_names = self._parameter_names(named_parameters, all_params)
        self._names = {p: f"allreduce.{name}" for p, name in self._plain_names.items()}
        self._requires_update = [p for p in all_params if p.requires_grad]
        if isinstance(groups, int) and not self._excluded:
            self._requires_update = self._in_reference_order(self._requires_update)
        self._groups = self._make_groups(groups)
        # Without explicit groups, gradients travel in buckets: one flat buffer per bucket, one
        # engine submission each (the engine's cost is per submission, not per byte).
        self._buckets = self._make_buckets() if groups is None else []
        self._bucket_buffers = [_BucketBuffer(b) for b in self._buckets]
        self._plan_reductions()
        self._pending: dict[Any, _Pending] = {}  # reduction key -> in flight
        self._ready: dict[tuple, int] = {}  # a group's or bucket's key -> members whose passes are done
        self._started = 0
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._delay = dict.fromkeys(self._key_of, self.backward_passes_per_step)  # id(p) -> passes to come
        self._hooks = [] if self._excluded else [
            p.register_post_accumulate_grad_hook(_weak_hook(self)) for p in self._requires_update]
        # The hooks live on the parameters, which outlive this optimizer when a script wraps a new
        # one over the same model: they hold it weakly and go away with it.
        weakref.finalize(self, _remove_hooks, self._hooks)

    # ---- setup helpers -------------------------------------------------------------------------

    def _plan_reductions(self) -> None:
        """Which reduction each parameter's gradient joins, by ``id(p)``: the hooks look it up once per
        gradient, and a tensor's own hash is a Python call, an id's is not.

        A key is ``("group", i)``, ``("bucket", i)``, or for a gradient reduced on its own its
        parameter's id; a bucket that falls back to per-tensor reductions (sparse gradients) keys
        them by their ids too.
        """
        key_of: dict[int, Any] = {id(p): id(p) for p in self._requires_update}
        self._members: dict[tuple, int] = {}
        for kind, sets in (("group", self._groups), ("bucket", self._buckets)):
            for i, members in enumerate(sets):
                key_of.update(dict.fromkeys(map(id, members), (kind, i)))
                self._members[(kind, i)] = len(members)
        self._key_of = key_of
        # Once a step has started them all, synchronize() need not look for the ones whose hooks did not fire.
        self._reductions = len(set(key_of.values()))

    @staticmethod
    def _parameter_names(named_parameters, all_params: list) -> dict:
        if named_parameters is None:
            return {p: f"noname.{i}" for i, p in enumerate(all_params)}
        pairs = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
            raise ValueError("named_parameters must be a sequence of (name, parameter) pairs, "
                             "e.g. model.named_parameters()")
        names = [name for name, _ in pairs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"parameter names in named_parameters must be unique; repeated: {duplicates}")
        by_param = {p: name for name, p in pairs}
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
        their gradients), planned by :mod:`hora.binding.gradient_buckets` (the rule every binding shares)."""
        cap = gradient_buckets.bucket_bytes()
        if self._excluded or not gradient_buckets.bucketable(self._op, self._compression):
            return []
        params = list(reversed(self._requires_update))
        sizes = [(p.numel() * p.element_size(), p.dtype) for p in params]
        return [[params[i] for i in bucket] for bucket in gradient_buckets.plan(sizes, cap)]

    # ---- hooks and reductions -------------------------------------------------------------------

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        ident = id(p)
        key = self._key_of.get(ident)
        if key is None:
            return
        if key in self._pending or ident in self._pending:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        left = self._delay[ident] - 1
        self._delay[ident] = left
        if left != 0:  # passes still to come, or (in a group not yet started) counted already
            return
        if key == ident:
            self._start_reduction(key, p)
            return
        ready = self._ready.get(key, 0) + 1
        self._ready[key] = ready
        if ready == self._members[key]:
            self._start_reduction(key, p)

    def _start_reduction(self, key: Any, p: torch.Tensor) -> None:
        """Start the reduction ``key`` stands for (see :meth:`_plan_reductions`); ``p`` is one of its parameters."""
        if key == id(p):
            self._start(p)
        elif key[0] == "group":
            self._start_group(key[1])
        else:
            self._start_bucket(key[1])
        self._started += 1

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
            self._pending[id(p)] = _Pending(sparse_handle, finish_sparse)
            return
        compressed, ctx = self._compression.compress(grad)
        r = self._reduction
        handle = mpi_ops.allreduce_async_(compressed, name=name, op=r.op, prescale_factor=r.prescale_factor,
                                          postscale_factor=r.postscale_factor, process_set=r.process_set)

        def finish(result, p=p, ctx=ctx, compressed=compressed):
            if compressed is not p.grad:
                self._land(p, self._compression.decompress(result, ctx))
        self._pending[id(p)] = _Pending(handle, finish)

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
        self._pending[("group", index)] = _Pending(handle, finish)

    def _start_bucket(self, index: int) -> None:
        flat = self._bucket_buffers[index].gradients()
        if flat is None:
            self._start_bucket_by_copy(index)
            return
        compressed, ctx = self._compression.compress(flat)
        handle = self._allreduce_bucket(compressed, self._buckets[index], self._bucket_buffers[index].tag)

        def finish(result, flat=flat, compressed=compressed, ctx=ctx):
            if compressed is not flat:
                self._decompress_into(flat, result, ctx)
        self._pending[("bucket", index)] = _Pending(handle, finish)

    def _start_bucket_by_copy(self, index: int) -> None:
        """A bucket whose gradients cannot be views of its buffer: flattened into a new tensor here
        and copied back at ``synchronize()``; sparse gradients (or sparse ones made dense) go per tensor."""
        params = self._buckets[index]
        grads = [self._dense_grad(p) for p in params]
        if any(g.is_sparse for g in grads) or any(g is not p.grad for g, p in zip(grads, params)):
            for p in params:
                self._start(p)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        compressed, ctx = self._compression.compress(flat)
        handle = self._allreduce_bucket(compressed, params)

        def finish(result, grads=grads, ctx=ctx):
            reduced = self._compression.decompress(result, ctx)
            pieces = torch.split(reduced, [g.numel() for g in grads])
            with torch.no_grad():
                torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(pieces, grads)])
        self._pending[("bucket", index)] = _Pending(handle, finish)

    def _allreduce_bucket(self, tensor: torch.Tensor, params: list, tag: str = "") -> mpi_ops.TorchHandle:
        r = self._reduction
        return mpi_ops.allreduce_async_(tensor, name=f"{self._names[params[0]]}.bucket{len(params)}{tag}", op=r.op,
                                        prescale_factor=r.prescale_factor, postscale_factor=r.postscale_factor,
                                        process_set=r.process_set)

    def _decompress_into(self, target: torch.Tensor, result: torch.Tensor, ctx: Any) -> None:
        """fp16 and bf16 decompress by casting back to ``target``'s dtype, which ``copy_`` does on its
        own: one copy instead of a cast and a copy."""
        with torch.no_grad():
            if self._compression in (Compression.fp16, Compression.bf16):
                target.copy_(result)
            else:
                target.copy_(self._compression.decompress(result, ctx))

    # ---- the optimizer interface ----------------------------------------------------------------

    def synchronize(self) -> None:
        """Finish every reduction of this step, starting those whose hooks did not fire."""
        if self._excluded:
            self._synchronized = True
            return
        if self._started < self._reductions:
            for p in self._requires_update:
                key = self._key_of[id(p)]
                if key in self._pending or id(p) in self._pending:  # (a bucket of sparse gradients: per tensor)
                    continue
                self._start_reduction(key, p)
        for pending in self._pending.values():
            pending.finish(mpi_ops.synchronize(pending.handle))
        self._pending.clear()
        self._new_step()
        self._synchronized = True

    def _new_step(self) -> None:
        """Every parameter waits for ``backward_passes_per_step`` passes again."""
        self._ready.clear()
        self._started = 0
        self._delay = dict.fromkeys(self._delay, self.backward_passes_per_step)

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
        self._new_step()
        self._synchronized = False
        self._should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = horovod_args.backward_passes(passes)
        self._delay = dict.fromkeys(self._delay, self.backward_passes_per_step)


def _every_gradient_bucketed(optimizer: _DistributedOptimizer) -> list[list]:
    """The buckets :meth:`_DistributedOptimizer._make_buckets` plans, with a parameter alone in a bucket
    of one where none takes it: for reductions that handle every gradient as part of a bucket (comm
    hooks, sharded gradients), whatever the op and compression."""
    if optimizer._excluded:
        return []
    params = list(reversed(optimizer._requires_update))
    sizes = [(p.numel() * p.element_size(), p.dtype) for p in params]
    return [[params[i] for i in bucket]
            for bucket in gradient_buckets.plan(sizes, gradient_buckets.bucket_bytes(), singles=True)]


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


class _DistributedStatefulOptimizer(_DistributedOptimizer):
    """Mixed in instead of :class:`_DistributedOptimizer` for a compression that keeps state between
    steps: ``Compression.powersgd(...)`` or ``Compression.topk(...)``.

    PowerSGD compresses every matrix of a step against the same shared factors, and top-k gathers
    every gradient's selection in one allgather, so the step's gradients are reduced together, at
    ``synchronize()``, by one reducer (:class:`PowerSGDReducer` or :class:`TopKReducer`) instead of
    bucket by bucket during the backward pass: on the slow links where compression pays, the bytes
    saved outweigh the overlap lost. The hooks only count ``backward_passes_per_step``. The reducer's
    state (each rank's residuals; PowerSGD's shared Q factors; the step count) is part of
    ``state_dict()`` under the reducer's ``STATE_KEY`` (``"hora_powersgd"``, ``"hora_topk"``), so a
    checkpoint resumes the same trajectory, and an elastic restore in a world of another size keeps
    what is shared and drops the residuals (see :func:`hora.torch.powersgd.state_for_new_world`).
    """

    _step_reducer: StepReducer

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        ident = id(p)
        left = self._delay.get(ident)
        if left is None:
            return
        if left == 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[ident] = left - 1

    def synchronize(self) -> None:
        """Average this step's gradients with the reducer (every rank the same names, missing ones as zeros)."""
        if self._excluded:
            self._synchronized = True
            return
        named, landing = [], []
        for p in self._requires_update:
            grad = self._dense_grad(p)
            if grad.is_sparse:
                raise ValueError(f"{self._step_reducer.spec!r}: parameter {self._names[p]!r} has a sparse "
                                 "gradient; pass sparse_as_dense=True to reduce it densely")
            named.append((self._plain_names[p], grad))
            if grad is not p.grad:
                landing.append((p, grad))
        self._step_reducer.reduce(named)
        for p, grad in landing:  # sparse_as_dense: back to the sparse form the optimizer expects
            self._land(p, grad)
        self._new_step()
        self._synchronized = True

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state[self._step_reducer.STATE_KEY] = self._step_reducer.state_dict()
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        reducer_state = state_dict.pop(self._step_reducer.STATE_KEY, None)
        super().load_state_dict(state_dict)
        if reducer_state is not None:
            self._step_reducer.load_state_dict(reducer_state)


class _DistributedHookOptimizer(_DistributedOptimizer):
    """Mixed in instead of :class:`_DistributedOptimizer` for ``comm_hook=...``: every gradient travels
    in a bucket (a parameter alone in a bucket of one), and each bucket, once its gradients are ready,
    goes to the hook instead of hora's allreduce; ``synchronize()`` waits on the futures the hook
    returned and writes their values into the gradients. See :mod:`hora.torch.comm_hooks`."""

    _comm_hook: Callable[[GradBucket], Any]

    def _make_buckets(self) -> list[list]:
        return _every_gradient_bucketed(self)

    def _start_bucket(self, index: int) -> None:
        params = self._buckets[index]
        buffer = self._bucket_buffers[index]
        flat = buffer.gradients()
        if flat is not None:
            grads = [p.grad for p in params]  # views of the buffer: reducing it reduces them
            landing = None
        else:  # gradients that cannot be views (mixed layouts, sparse_as_dense): a flat copy, landed after
            landing = [self._dense_grad(p) for p in params]
            sparse = [self._plain_names[p] for p, g in zip(params, landing) if g.is_sparse]
            if sparse:
                raise ValueError(f"comm_hook takes dense gradients; {sparse} are sparse: pass sparse_as_dense=True")
            flat = torch.cat([g.reshape(-1) for g in landing])
            grads = list(torch.split(flat, [g.numel() for g in landing]))
            grads = [g.view(p.shape) for g, p in zip(grads, params)]
        name = f"{self._names[params[0]]}.hook{len(params)}{buffer.tag}"
        bucket = GradBucket(index, flat, list(params), [self._plain_names[p] for p in params], grads,
                            index == len(self._buckets) - 1, self._process_set, name)
        future = self._comm_hook(bucket)
        if not callable(getattr(future, "wait", None)):
            raise TypeError(f"comm_hook must return a future (with wait()), such as hora.torch.comm_hooks.HookFuture "
                            f"or torch.futures.Future; it returned {type(future).__name__} for bucket {index}")

        def finish(result, flat=flat, params=params, landing=landing, index=index):
            if not isinstance(result, torch.Tensor) or result.numel() != flat.numel():
                got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
                raise ValueError(f"comm_hook's future for bucket {index} gave {got}; it must give the bucket's "
                                 f"{flat.numel()} elements (bucket.buffer(), reduced)")
            with torch.no_grad():
                if result is not flat:
                    flat.copy_(result.reshape(flat.shape))
                if landing is not None:
                    pieces = torch.split(flat, [g.numel() for g in landing])
                    for p, piece in zip(params, pieces):
                        self._land(p, piece.view(p.shape))
        self._pending[("bucket", index)] = _Pending(future, finish)


class _ShardedStep(_OptimizerBase):
    """Stands after :class:`_DistributedOptimizer` in a sharded optimizer's MRO, where the wrapped
    optimizer's own ``step`` would be: every path of ``_DistributedOptimizer.step`` (plain, with a
    closure, under ``skip_synchronize``) ends in its ``super().step()``, which lands here and steps
    this rank's shard only, then gathers the parameters."""

    _zero: ZeroRedundancyOptimizer

    def step(self, closure=None):
        return self._zero.step_averaged(closure)


class _ShardedDistributedOptimizer(_DistributedOptimizer, _ShardedStep):
    """Mixed in for ``shard_optimizer_state=True`` (ZeRO stage 1 behind Horovod's optimizer).

    Gradients are averaged exactly as without sharding (hooks, buckets, compression,
    ``backward_passes_per_step``); the step is a :class:`~hora.torch.zero.ZeroRedundancyOptimizer`'s
    (``self._zero``) over the same parameter groups (the very group dicts, so a learning-rate scheduler
    that changes ``param_groups`` changes what the shard steps with): an instance of the wrapped class
    over this rank's shard steps it, and allgathers bring the updated parameters back.
    ``state`` is that shard's state; checkpoints go through :meth:`consolidate_state_dict`, as with
    ``ZeroRedundancyOptimizer``.
    """

    def _hora_shard(self, base: type, carried: dict) -> None:
        self._zero = ZeroRedundancyOptimizer(self.param_groups, base, process_set=self._process_set,
                                             **self.defaults)
        if carried:  # state the optimizer had before it was wrapped: each rank keeps its shard's
            self._zero.keep_owned_state(carried)
        self._probe: mpi_ops.TorchHandle | None = None  # this step's join probe, once submitted
        self._serving = False  # taking part in the others' step from inside hvd.join()
        sharded_join.unregister(self._zero)  # hvd.join() drives this optimizer, hooks and all
        if self._process_set.included():  # even alone: an elastic world may grow
            sharded_join.register(self)

    # ---- hvd.join() (hora.torch.sharded_join) -----------------------------------------------------

    @property
    def join_probe_name(self) -> str:
        return self._zero.join_probe_name

    @property
    def join_process_set(self) -> ProcessSet:
        return self._process_set

    @property
    def _probing(self) -> bool:
        """Whether this rank's steps probe for ranks in ``hvd.join()`` (a member of a set of several)."""
        return not self._excluded and self._process_set.size() > 1

    def _probe_this_step(self) -> None:
        """Submit this step's join probe, before any of the step's collectives (the first bucket's may
        check the parameters or reshard, which a joined rank takes part in only once probed)."""
        if self._probe is None and not self._serving and self._probing:
            self._probe = sharded_join.start_probe(self, sharded_join.STEP)

    def _reduce_through_join(self) -> None:
        """The step's reductions and the optimizer's first-collective checks, as every rank (a joined
        one too) takes part in them."""
        with collectives.through_join():
            _DistributedOptimizer.synchronize(self)
            # The first step's parameter check (or a reshard elastic training left): here, where a
            # joined rank takes part too, not in clip_grad_norm_ or step, which it may not reach alike.
            self._zero.before_collectives()

    def _start_reduction(self, key: Any, p: torch.Tensor) -> None:
        self._probe_this_step()
        with collectives.through_join():
            super()._start_reduction(key, p)

    def synchronize(self) -> None:
        """Finish this step's reductions. Ranks in ``hvd.join()`` take part in the step with zero
        gradients (:mod:`hora.torch.sharded_join`): the step's probe says which, and while there are
        any, every rank takes the parameter groups' settings of the lowest training rank."""
        self._probe_this_step()
        self._reduce_through_join()
        probe, self._probe = self._probe, None
        if probe is not None:
            training, _ = sharded_join.probed(probe)
            if len(training) < self._process_set.size():
                sharded_join.agree_on_step(self, self.param_groups, training)

    def _step_with_closure(self, closure):
        # Probed before anything of the step: a rank in hvd.join() cannot run the closure, so the step
        # is refused while one is there (it skips the step; see hora.torch.sharded_join).
        if self._probing:
            training, _ = sharded_join.probed(sharded_join.start_probe(self, sharded_join.CLOSURE_STEP))
            if len(training) < self._process_set.size():
                raise sharded_join.refusal(self, "DistributedOptimizer(shard_...).step(closure)", training)
        return super()._step_with_closure(closure)

    def _reset_step(self) -> None:
        super()._reset_step()
        probe, self._probe = self.__dict__.get("_probe"), None
        if probe is not None:
            try:
                mpi_ops.synchronize(probe)
            except HoraError:
                pass  # the job is failing (elastic restore): the step is dropped anyway

    def serve_joined_step(self, training: list[int]) -> None:
        """On a rank in ``hvd.join()``: the ``training`` members' step, with zero gradients from this rank."""
        for p in self._requires_update:
            p.grad = None  # reduced as zeros
        self._serving = True
        try:
            self._reduce_through_join()
            sharded_join.agree_on_step(self, self.param_groups, training)
            with self.skip_synchronize():
                self.step()
        finally:
            self._serving = False

    @property
    def state(self) -> Any:
        """This rank's optimizer state: its shard's only."""
        zero = self.__dict__.get("_zero")
        return zero.state if zero is not None else self.__dict__.get("_state_before_shard")

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["_state_before_shard"] = value

    @property
    def shard_plan(self):
        """Which member of the process set owns which parameter (positions in ``param_groups`` order)."""
        return self._zero.shard_plan

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state on rank ``to`` (every member calls it); ``state_dict()`` there returns it."""
        self._zero.consolidate_state_dict(to)

    def state_dict(self) -> dict[str, Any]:
        """The whole state as last consolidated on this rank; RuntimeError before
        :meth:`consolidate_state_dict`, as with torch's ``ZeroRedundancyOptimizer``."""
        return self._zero.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load a whole state (consolidated at any world size, or an unsharded optimizer's): every rank
        passes all of it and keeps its own shard; the next step starts afresh, as without sharding."""
        self._reset_step()
        self._zero.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("DistributedOptimizer(shard_optimizer_state=True) cannot add parameter groups after "
                         "it is built (its hooks and shard plan cover the parameters it was given): add them "
                         "to the optimizer before wrapping it")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter of the process set, for the averaged
        gradients (call it between ``synchronize()`` and ``step()`` under ``skip_synchronize()``): the
        norm is combined from each rank's shard, so it is the whole model's whether or not the
        gradients are sharded (with ``shard_gradients=True`` torch's own function sees one shard)."""
        return _clip_sharded_grad_norm_(self._zero, max_norm, norm_type, error_if_nonfinite)


class _GradientShardedDistributedOptimizer(_ShardedDistributedOptimizer):
    """Mixed in for ``shard_gradients=True`` (ZeRO stage 2, which includes stage 1's sharded state).

    Every gradient travels in a bucket (a parameter alone in a bucket of one where needed), and each
    bucket, once backward has produced it, is reducescattered to the members that own its
    parameters (:class:`~hora.torch.gradient_shards.GradientShards`); the gradients of the parameters
    this rank does not own are released then. ``step()`` steps the shard with the averaged gradients
    it received and allgathers the parameters, as with stage 1.
    """

    def _make_buckets(self) -> list[list]:
        return _every_gradient_bucketed(self)

    def _hora_shard(self, base: type, carried: dict) -> None:
        super()._hora_shard(base, carried)
        self._gradient_shards = GradientShards(self._buckets, self._zero)
        self._in_flight: deque[tuple[str, int]] = deque()

    def _start_bucket(self, index: int) -> None:
        # Buckets whose reducescatter has finished land first, so that their packed buffers and results
        # go while backward is still running. Never waiting for one here: a peer may submit a bucket
        # only in synchronize() (a parameter it did not use), and a wait in backward would deadlock it.
        while self._in_flight and self._pending[self._in_flight[0]].handle.poll():
            oldest = self._in_flight.popleft()
            pending = self._pending[oldest]
            pending.finish(mpi_ops.synchronize(pending.handle))
            self._pending[oldest] = _Pending(completed(), _landed)  # still this step's: a second pass is refused
        params = self._buckets[index]
        handle, finish = self._gradient_shards.start(index, f"{self._names[params[0]]}.shards{len(params)}",
                                                     self._reduction, self._compression, self._sparse_as_dense)
        key = ("bucket", index)
        self._pending[key] = _Pending(handle, finish)
        self._in_flight.append(key)

    def _new_step(self) -> None:
        super()._new_step()
        self._in_flight.clear()


def _landed(result: None) -> None:
    """Nothing left to land: the bucket's result went into the gradients when it arrived."""


def _check_sharding_arguments(reduction: GradientReduction, stateful: StatefulCompressionSpec | None,
                              shard_gradients: bool, compression: Any, groups: Any) -> None:
    flag = "shard_gradients=True" if shard_gradients else "shard_optimizer_state=True"
    if reduction.op == Adasum:
        raise ValueError(f"{flag} does not take op=Adasum: Adasum combines every rank's "
                         "local step of every parameter, which needs every parameter's state on every rank")
    if stateful is not None:
        raise ValueError(f"{flag} does not take {_spec_name(stateful)} yet: use "
                         "Compression.none, fp16 or bf16, or leave the state unsharded")
    if not shard_gradients:
        return
    if compression not in _SHARDED_GRADIENT_COMPRESSIONS:
        raise ValueError(f"shard_gradients=True compresses each packed bucket of gradients, so it takes the "
                         f"element-wise Compression.none, fp16 or bf16, not {compression!r}")
    if groups is not None:
        raise ValueError("shard_gradients=True reduces the gradients in buckets in backward's order: num_groups "
                         "and groups do not apply to it; leave them unset")


def _spec_name(spec: StatefulCompressionSpec) -> str:
    return "Compression.powersgd" if isinstance(spec, PowerSGDSpec) else "Compression.topk"


def _check_stateful_arguments(spec: StatefulCompressionSpec, reduction: GradientReduction, groups: Any) -> None:
    """What PowerSGD and top-k cannot do, refused when the optimizer is built rather than silently ignored."""
    name = _spec_name(spec)
    if reduction.op != Average:
        raise ValueError(f"{name} averages the gradients: it takes op=Average (the default), "
                         f"not {reduction.op.name}")
    if reduction.prescale_factor != 1.0 or reduction.postscale_factor != 1.0:
        raise ValueError(f"{name} computes in float32 and needs no gradient_predivide_factor: leave it at 1.0")
    if groups is not None:
        raise ValueError(f"{name} reduces all of a step's gradients together: num_groups and "
                         "groups do not apply to it; leave them unset")


def _check_hook_arguments(hook: Any, reduction: GradientReduction, compression: Any, groups: Any,
                          shard_optimizer_state: bool) -> None:
    """A hook decides how each bucket is reduced: the arguments that would say it too are refused
    when the optimizer is built rather than silently overridden."""
    if not callable(hook):
        raise TypeError(f"comm_hook must be a callable taking a hora.torch.comm_hooks.GradBucket, got {hook!r}")
    conflicts = []
    if reduction.op != Average:
        conflicts.append(f"op={reduction.op.name}")
    if reduction.prescale_factor != 1.0 or reduction.postscale_factor != 1.0:
        conflicts.append("gradient_predivide_factor")
    if compression is not Compression.none:
        conflicts.append(f"compression={compression!r}")
    if groups is not None:
        conflicts.append("num_groups/groups")
    if shard_optimizer_state:
        conflicts.append("shard_optimizer_state=True or shard_gradients=True")
    if conflicts:
        raise ValueError(f"comm_hook decides how each gradient bucket is reduced; it does not combine with "
                         f"{', '.join(conflicts)}: leave them at their defaults and do it in the hook")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *,
                         shard_optimizer_state: bool = False, shard_gradients: bool = False,
                         comm_hook: Callable[[GradBucket], Any] | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged across all ranks.

    The result is an instance of the wrapped optimizer's own class (``isinstance`` checks and
    learning-rate schedulers keep working) sharing its parameter groups, state and hyper-parameters.

    ``shard_optimizer_state=True`` (a hora addition, ZeRO stage 1): gradients are averaged as without
    it, but each rank of ``process_set`` keeps the optimizer state of its own shard of the parameters
    only and steps only that shard; the updated parameters are then allgathered, so every rank holds
    the whole model. Checkpoint with ``consolidate_state_dict(to)`` then ``state_dict()`` on rank
    ``to``, as with :class:`~hora.torch.ZeroRedundancyOptimizer` (docs/memory.md).

    ``shard_gradients=True`` (a hora addition, ZeRO stage 2, which includes stage 1's sharded state):
    each gradient bucket is reducescattered during the backward pass instead of allreduced, so a rank
    receives the averaged gradients of its own shard only and releases the others; between steps it
    holds 1/N of the gradients. Clip with the optimizer's ``clip_grad_norm_`` (torch's function would
    see one shard). With ``backward_passes_per_step`` above 1 the local gradients of the whole model
    accumulate until the last pass, as without sharding.

    ``comm_hook=hook`` (a hora addition, after DDP's ``register_comm_hook``): each gradient bucket goes
    to ``hook(bucket)``, which returns a future of the reduced bucket (:mod:`hora.torch.comm_hooks`);
    the hook then decides how gradients are reduced, so ``op``, ``gradient_predivide_factor``,
    ``compression``, ``groups`` and ``shard_optimizer_state`` keep their defaults.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a hora DistributedOptimizer: wrapping it again would reduce "
                         "every gradient twice; wrap the original optimizer once")
    groups = horovod_args.resolve_groups(num_groups, groups)
    passes = horovod_args.backward_passes(backward_passes_per_step)
    reduction = GradientReduction.create(op, gradient_predivide_factor, process_set)
    compression = horovod_args.check_compression(compression, stateful=True)
    stateful = compression if isinstance(compression, StatefulCompressionSpec) else None
    shard_gradients = bool(shard_gradients)
    shard_optimizer_state = bool(shard_optimizer_state) or shard_gradients
    if comm_hook is not None:
        _check_hook_arguments(comm_hook, reduction, compression, groups, shard_optimizer_state)
    if shard_optimizer_state:
        _check_sharding_arguments(reduction, stateful, shard_gradients, compression, groups)
    if stateful is not None:
        _check_stateful_arguments(stateful, reduction, groups)
        compression = Compression.none  # the reducer compresses; nothing else does
    basics.engine()  # fail early, with the init() message, when hora is not initialised
    base = optimizer.__class__
    mixin: type[_DistributedOptimizer] = _DistributedOptimizer
    if reduction.op == Adasum:  # Horovod's Adasum optimizer: the deltas of a local step are reduced
        mixin = _DistributedAdasumOptimizer
    elif stateful is not None:
        mixin = _DistributedStatefulOptimizer
    elif comm_hook is not None:
        mixin = _DistributedHookOptimizer
    elif shard_gradients:
        mixin = _GradientShardedDistributedOptimizer
    elif shard_optimizer_state:
        mixin = _ShardedDistributedOptimizer
    cls: type[object] = type(base.__name__, (mixin, base),
                             {"__module__": base.__module__, "__qualname__": base.__qualname__})
    wrapped: Any = cls.__new__(cls)
    # Leave behind instance attributes that would shadow the wrapper's methods: an LR scheduler built
    # on the plain optimizer replaces its ``step`` with a bound wrapper that would skip the allreduce.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if k not in _DistributedOptimizer.__dict__})
    if shard_optimizer_state:
        whole_state = wrapped.__dict__.pop("state", {})  # the class's ``state`` property reads the shard's
        carried = {p: s for p, s in whole_state.items() if s}
    if comm_hook is not None:
        wrapped._comm_hook = comm_hook
    wrapped._hora_setup(named_parameters, compression, passes, reduction, groups, sparse_as_dense)
    if shard_optimizer_state:
        wrapped._hora_shard(base, carried)
        whole_state.clear()  # shared with the optimizer passed in: only this rank's shard stays referenced
    if stateful is not None:
        first = wrapped._names[wrapped._requires_update[0]] if wrapped._requires_update else "no_parameters"
        # Named after the first parameter, as grouped reductions are: the same on every rank.
        if isinstance(stateful, PowerSGDSpec):
            wrapped._step_reducer = PowerSGDReducer(stateful, process_set, name=f"{first}.powersgd")
        elif isinstance(stateful, TopKSpec):
            wrapped._step_reducer = TopKReducer(stateful, process_set, name=f"{first}.topk")
        else:
            raise TypeError(f"hora.torch.DistributedOptimizer has no reducer for {stateful!r}")
    return wrapped
