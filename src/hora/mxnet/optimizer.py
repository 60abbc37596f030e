"""Horovod's two ways of averaging MXNet gradients across ranks.

``DistributedOptimizer`` wraps an ``mx.optimizer.Optimizer``: every ``update`` first sums the
gradients it is given over the ranks, in place. ``DistributedTrainer`` is a ``gluon.Trainer`` whose
``allreduce_grads`` step sums every parameter's gradient over the ranks (all submitted at once, so
hora's engine fuses them) instead of going through a kvstore. Both average as Horovod does: the sum
is taken with a prescale of ``1 / gradient_predivide_factor``, and the optimizer's ``rescale_grad``
(or the trainer's scale) is multiplied by ``gradient_predivide_factor / size``, so the update sees
the gradient of the mean loss over every rank's samples.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mxnet as mx

from hora import horovod_args
from hora.basics import ProcessSet, global_process_set
from hora.binding import batched
from hora.horovod_args import GradientReduction
from hora.mxnet.compression import Compression
from hora.mxnet.tensors import check_dtype, new_like, to_host, where, write_into
from hora.transport.base import ReduceOp


def _sum_reduction(gradient_predivide_factor: float, process_set: ProcessSet) -> GradientReduction:
    """Horovod's MXNet reduction: a Sum with prescale 1/f (the 1/size and f are in the optimizer's scale)."""
    factor = float(gradient_predivide_factor)
    if not factor > 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
    return GradientReduction(ReduceOp.SUM, 1.0 / factor, 1.0, process_set)


def _groups(num_groups: int) -> int | None:
    if int(num_groups) < 0:
        raise ValueError(f"num_groups must be >= 0, got {num_groups}")
    return int(num_groups) or None


def _reduce_in_place(grads: Sequence[mx.nd.NDArray], names: Sequence[str], reduction: GradientReduction,
                     groups: int | None, compression: Any = Compression.none) -> None:
    """Sum ``grads`` over the process set (compressed on the wire) and write the results back into them."""
    compressed = [compression.compress(g) for g in grads]
    arrays = [to_host(c, "gradient allreduce") for c, _ in compressed]
    results = batched.start(arrays, names, reduction, groups).wait()
    for grad, (c, ctx), result in zip(grads, compressed, results):
        if c is grad:  # sent as it is: one host copy back
            write_into(grad, result)
        else:
            grad[:] = compression.decompress(new_like(result, c), ctx)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """An ``mx.optimizer.Optimizer`` that sums each gradient over the ranks before updating.

    Use it where MXNet calls an optimizer directly (``Module.fit(optimizer=..., kvstore=None)``, or a
    ``gluon.Trainer(..., kvstore=None)``). Attributes read or set on the wrapper (``lr``,
    ``rescale_grad``, ...) are the wrapped optimizer's: Gluon's Trainer sets ``rescale_grad`` on the
    optimizer it holds each step, and that must reach the optimizer that updates.
    """

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set) -> None:
        reduction = _sum_reduction(gradient_predivide_factor, process_set)
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_reduction", reduction)
        object.__setattr__(self, "_num_groups", _groups(num_groups))
        object.__setattr__(self, "_process_set", process_set)
        object.__setattr__(self, "_gradient_predivide_factor", float(gradient_predivide_factor))
        # Horovod's MXNet optimizer takes no compression argument; HORA_COMPRESSION (hora run
        # --compression) still reaches it, as it reaches every gradient wrapper left at none.
        object.__setattr__(self, "_compression", horovod_args.check_compression(Compression.none))
        optimizer.rescale_grad *= float(gradient_predivide_factor) / process_set.size()

    def __getattr__(self, item: str) -> Any:
        return getattr(self._optimizer, item)

    def __setattr__(self, key: str, value: Any) -> None:
        setattr(self._optimizer, key, value)

    def create_state(self, index: Any, weight: mx.nd.NDArray) -> Any:
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: mx.nd.NDArray) -> Any:
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index: Any, grad: Any) -> None:
        ps = self._process_set
        if ps.size() == 1 or not ps.included():
            return
        indices = list(index) if isinstance(index, (tuple, list)) else [index]
        grads = list(grad) if isinstance(grad, (tuple, list)) else [grad]
        for i, g in zip(indices, grads):
            check_dtype(g, f"DistributedOptimizer (gradient of parameter index {i})")
        _reduce_in_place(grads, [f"mxnet.optimizer.{i}" for i in indices], self._reduction, self._num_groups,
                         self._compression)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: dict) -> None:
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` that sums gradients over the ranks with hora instead of a kvstore.

    ``trainer.step(batch_size)`` with each rank's own batch size then updates with the gradient of
    the mean loss over every rank's samples. ``prefix`` names this trainer's tensors (two trainers in
    one script need different prefixes); ``num_groups`` > 0 reduces the gradients in that many
    grouped allreduces; ``compression`` (``Compression.fp16``) halves the bytes sent.
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None,
                 compression: Any = Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: str | None = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        self._compression = horovod_args.check_compression(compression)
        self._reduction = _sum_reduction(gradient_predivide_factor, process_set)
        self._process_set = process_set
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take a DistributedOptimizer as its optimizer; "
                          "it has been unwrapped", UserWarning, stacklevel=2)
        if isinstance(params, dict):
            params = OrderedDict(params)
        elif isinstance(params, (list, tuple)):
            # the same order on every rank, whatever order the script built the list in
            params = sorted(params, key=lambda p: p.name)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._scale *= float(gradient_predivide_factor) / process_set.size()
        self._gradient_predivide_factor = float(gradient_predivide_factor)
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str or None, got {type(prefix).__name__}")
        self._prefix = prefix or ""
        self._num_groups = _groups(num_groups)

    def _allreduce_grads(self) -> None:
        ps = self._process_set
        if ps.size() == 1 or not ps.included():
            return
        grads, names = [], []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grad = param.list_grad()[0]
            if grad.stype != "default":
                raise ValueError(f"hora.mxnet.DistributedTrainer ({where()}): parameter {param.name!r} has a "
                                 f"{grad.stype} gradient; hora reduces dense gradients only (Horovod's MXNet "
                                 "trainer does too): create it with sparse_grad=False")
            grads.append(grad)
            names.append(f"{self._prefix}{i}")
        _reduce_in_place(grads, names, self._reduction, self._num_groups, self._compression)
