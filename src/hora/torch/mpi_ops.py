"""Collectives on torch tensors, with horovod.torch's names, signatures and defaults.

Each call converts the tensor to the engine's NumPy buffer (a view for contiguous CPU tensors),
submits through hora's NumPy binding and converts back when the handle is synchronised. The plain
forms are differentiable; ``_async`` forms return a handle; a trailing ``_`` works in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hora import basics, collectives, horovod_args
from hora.basics import Average, ProcessSet, Sum, global_process_set
from hora.binding import (
    ConvertingHandle,
    as_is,
    new_each,
    new_one,
    poll as poll,
    synchronize as synchronize,
    write_one,
)
from hora.engine.request import Kind
from hora.torch import tensors as adapter
from hora.torch.compression import Compression
from hora.torch.device import cuda_request
from hora.torch.tensors import check_dtype, new_like, shares_memory, to_host


class TorchHandle(ConvertingHandle):
    """What the ``_async`` collectives return: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ()


class SparseHandle(TorchHandle):
    """What :func:`sparse_allreduce_async` returns. As in Horovod, calling it waits and returns the
    reduced sparse tensor; :func:`poll` and :func:`synchronize` work on it too."""

    __slots__ = ()

    def __call__(self) -> torch.Tensor:
        return self.wait()


# ---- CUDA tensors on NCCL (hora.torch.device); everything else goes through host memory -----------

def _grouped_allreduce_cuda(tensors: Sequence[torch.Tensor], name: str | None, process_set: ProcessSet,
                            inplace: bool, **fields: Any) -> TorchHandle | None:
    """A grouped allreduce on NCCL when every member takes the device path, else None (host path)."""
    if not tensors or not all(t.is_cuda for t in tensors):
        return None
    base, names = collectives.group_names(name, len(tensors), "allreduce", process_set)
    requests = [cuda_request(Kind.ALLREDUCE, t, n, process_set, inplace, group=base, group_size=len(tensors),
                             **fields) for t, n in zip(tensors, names)]
    device_requests = [r for r in requests if r is not None]
    if len(device_requests) < len(requests):
        return None
    return TorchHandle(collectives.submit_requests(device_requests), as_is)


def _broadcast_cuda(tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet,
                    inplace: bool) -> Any:
    if not tensor.is_cuda:
        return None
    collectives.check_root(root_rank, process_set)
    return cuda_request(Kind.BROADCAST, tensor, name, process_set, inplace, root=int(root_rank))


# ---- allreduce ----------------------------------------------------------------------------------

def _inplace(tensor: torch.Tensor) -> tuple[np.ndarray, Callable[[Any], torch.Tensor]]:
    """A buffer the engine may overwrite, and how to land its contents in ``tensor``."""
    check_dtype(tensor)
    if shares_memory(tensor):
        return to_host(tensor), lambda _: tensor
    return to_host(tensor).copy(), write_one(adapter, tensor)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start reducing ``tensor`` across ranks; :func:`synchronize` returns a new tensor."""
    if tensor.is_cuda:  # on NCCL when it can carry it: the result is a CUDA tensor, chained on its stream
        request = cuda_request(Kind.ALLREDUCE, tensor, name, process_set, op=horovod_args.resolve_op(op, average),
                               prescale=prescale_factor, postscale=postscale_factor)
        if request is not None:
            return TorchHandle(collectives.submit_requests([request])[0], as_is)
    handle = collectives.allreduce_async(to_host(tensor), average, name, op, prescale_factor,
                                         postscale_factor, process_set)
    return TorchHandle(handle, new_one(adapter, tensor))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start reducing ``tensor`` in place."""
    if tensor.is_cuda:
        request = cuda_request(Kind.ALLREDUCE, tensor, name, process_set, inplace=True,
                               op=horovod_args.resolve_op(op, average), prescale=prescale_factor,
                               postscale=postscale_factor)
        if request is not None:
            return TorchHandle(collectives.submit_requests([request])[0], as_is)
    buf, finish = _inplace(tensor)
    handle = collectives.allreduce_async_(buf, average, name, op, prescale_factor, postscale_factor, process_set)
    return TorchHandle(handle, finish)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Unrecorded:
    """What a collective's autograd Function gets as ``ctx`` when nothing needs recording: what its
    forward saves for backward goes nowhere."""

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


def _apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)`` where autograd must record the call (grad enabled and an input that
    requires grad); otherwise its forward runs directly, skipping the autograd Function's own per-call
    cost, which is of the order of a small collective's."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return function.apply(*args)
    return function.forward(_Unrecorded(), *args)


def _op_for_grad(average: bool | None, op: int | None) -> int:
    return horovod_args.resolve_op(op, average)


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (_op_for_grad(average, op), prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, ps = ctx.args
        grad = synchronize(allreduce_async(grad_output.contiguous(), None, None, op, pre, post, ps))
        return grad, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (Average by default); differentiable."""
    compressed, ctx = compression.compress(tensor)
    reduced = _apply(_AllreduceFunction, compressed, average, name, op, prescale_factor, postscale_factor,
                     process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start reducing a list of tensors as one fused unit."""
    device = _grouped_allreduce_cuda(tensors, name, process_set, False, op=horovod_args.resolve_op(op, average),
                                     prescale=prescale_factor, postscale=postscale_factor)
    if device is not None:
        return device
    handles = collectives.grouped_allreduce_async([to_host(t) for t in tensors], average, name, op,
                                                  prescale_factor, postscale_factor, process_set)
    return TorchHandle(handles, new_each(adapter, tensors))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> TorchHandle:
    device = _grouped_allreduce_cuda(tensors, name, process_set, True, op=horovod_args.resolve_op(op, average),
                                     prescale=prescale_factor, postscale=postscale_factor)
    if device is not None:
        return device
    pairs = [_inplace(t) for t in tensors]
    handles = collectives.grouped_allreduce_async_([buf for buf, _ in pairs], average, name, op,
                                                   prescale_factor, postscale_factor, process_set)
    finishes = [finish for _, finish in pairs]
    return TorchHandle(handles, lambda results: [f(r) for f, r in zip(finishes, results)])


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (_op_for_grad(average, op), prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        op, pre, post, ps = ctx.args
        grads = synchronize(grouped_allreduce_async([g.contiguous() for g in grad_outputs], None, None, op,
                                                    pre, post, ps))
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused unit; differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    reduced = _apply(_GroupedAllreduceFunction, average, name, op, prescale_factor, postscale_factor,
                     process_set, *[c for c, _ in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


# ---- allgather ----------------------------------------------------------------------------------

def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start concatenating every rank's tensor along dimension 0."""
    request = cuda_request(Kind.ALLGATHER, tensor if tensor.dim() else tensor.reshape(1), name, process_set)
    if request is not None:
        return TorchHandle(collectives.submit_requests([request])[0], as_is)
    return TorchHandle(collectives.allgather_async(to_host(tensor), name, process_set), new_one(adapter, tensor))


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        ps = ctx.process_set
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, process_set=ps))
        dims = synchronize(allgather_async(torch.tensor([ctx.dim], dtype=torch.int64), process_set=ps))
        me = ps.ranks.index(basics.rank())
        offset = int(dims[:me].sum())
        return grad.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0 (first dimensions may differ); differentiable."""
    return _apply(_AllgatherFunction, tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> TorchHandle:
    handles = collectives.grouped_allgather_async([to_host(t) for t in tensors], name, process_set)
    return TorchHandle(handles, new_each(adapter, tensors))


class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        # as for allgather: sum the upstream gradients over ranks, keep this rank's rows of each
        ps = ctx.process_set
        grads = synchronize(grouped_allreduce_async([g.contiguous() for g in grad_outputs], op=Average, process_set=ps))
        dims = synchronize(allgather_async(torch.tensor([ctx.dims], dtype=torch.int64), process_set=ps))
        me = ps.ranks.index(basics.rank())
        offsets = dims[:me].sum(0).tolist()
        return (None, None, *[g.narrow(0, o, d) for g, o, d in zip(grads, offsets, ctx.dims)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of the list, as one fused unit; differentiable."""
    return list(_apply(_GroupedAllgatherFunction, name, process_set, *tensors))


# ---- broadcast ----------------------------------------------------------------------------------

def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    request = _broadcast_cuda(tensor, root_rank, name, process_set, False)
    if request is not None:
        return TorchHandle(collectives.submit_requests([request])[0], as_is)
    return TorchHandle(collectives.broadcast_async(to_host(tensor), root_rank, name, process_set),
                       new_one(adapter, tensor))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> TorchHandle:
    request = _broadcast_cuda(tensor, root_rank, name, process_set, True)
    if request is not None:
        return TorchHandle(collectives.submit_requests([request])[0], as_is)
    buf, finish = _inplace(tensor)
    return TorchHandle(collectives.broadcast_async_(buf, root_rank, name, process_set), finish)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, process_set=ctx.process_set))
        if basics.rank() != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s tensor on every rank; differentiable (the gradient flows to the root)."""
    return _apply(_BroadcastFunction, tensor, root_rank, name, process_set)


# ---- alltoall -----------------------------------------------------------------------------------

def _splits_list(splits: Any) -> Any:
    if isinstance(splits, torch.Tensor):
        return splits.detach().cpu().numpy()
    return splits


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start sending ``splits[j]`` rows to rank j; synchronize returns ``(output, received_splits)``."""
    if tensor.is_cuda:
        split_list = collectives.alltoall_splits(tuple(tensor.shape), _splits_list(splits), process_set)
        request = cuda_request(Kind.ALLTOALL, tensor, name, process_set, splits=tuple(split_list))
        if request is not None:
            return TorchHandle(collectives.submit_requests([request])[0],
                               lambda res: (res[0], torch.from_numpy(res[1]).to(torch.int32)))
    handle = collectives.alltoall_async(to_host(tensor), _splits_list(splits), name, process_set)
    return TorchHandle(handle, lambda res: (new_like(res[0], tensor), torch.from_numpy(res[1]).to(torch.int32)))


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _grad_received):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received, process_set=ctx.process_set))
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Exchange rows between ranks; returns the output, or ``(output, received_splits)`` with splits."""
    output, received = _apply(_AlltoallFunction, tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# ---- reducescatter ------------------------------------------------------------------------------

def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, blocks: Sequence[int] | None = None,
                        donate: bool = False) -> TorchHandle:
    """``blocks`` (a hora addition): the rows each member receives, the same on every rank; None for
    Horovod's equal blocks. ``donate=True`` (a hora addition): ``tensor`` is a temporary the caller
    will not touch again, which the engine may read and scale in place instead of copying."""
    if tensor.is_cuda and tensor.dim():
        request = cuda_request(Kind.REDUCESCATTER, tensor, name, process_set,
                               op=horovod_args.check_sum_or_average(op, "reducescatter"),
                               prescale=prescale_factor, postscale=postscale_factor,
                               splits=collectives.reducescatter_splits(tuple(tensor.shape), blocks, process_set))
        if request is not None:
            return TorchHandle(collectives.submit_requests([request])[0], as_is)
    handle = collectives.reducescatter_async(to_host(tensor), name, op, process_set, prescale_factor,
                                             postscale_factor, blocks=blocks, donate=donate)
    return TorchHandle(handle, new_one(adapter, tensor))


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor, blocks, donate):
        ctx.args = (op, process_set, prescale_factor * postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor,
                                               blocks=blocks, donate=donate))

    @staticmethod
    def backward(ctx, grad_output):
        op, ps, scale = ctx.args
        grad = synchronize(allgather_async(grad_output.contiguous(), process_set=ps))  # blocks of any size
        if op == Sum:  # Horovod's convention (same results after migrating): Sum scales by size,
            scale *= len(ps.ranks)  # Average passes the gathered gradient through
        return (grad * scale if scale != 1.0 else grad), None, None, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, *, blocks: Sequence[int] | None = None,
                  donate: bool = False) -> torch.Tensor:
    """Reduce across ranks and keep this rank's block of rows; differentiable. ``blocks`` and
    ``donate`` are hora's additions (see :func:`reducescatter_async`)."""
    compressed, ctx = compression.compress(tensor)
    out = _apply(_ReducescatterFunction, compressed, name, op, process_set, prescale_factor, postscale_factor,
                 blocks, donate)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> TorchHandle:
    handles = collectives.grouped_reducescatter_async([to_host(t) for t in tensors], name, op, process_set,
                                                      prescale_factor, postscale_factor)
    return TorchHandle(handles, new_each(adapter, tensors))


class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor * postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        # as for reducescatter: gather every rank's block gradient, scaled as the forward scaled
        op, ps, scale = ctx.args
        grads = synchronize(grouped_allgather_async([g.contiguous() for g in grad_outputs], process_set=ps))
        if op == Sum:  # Horovod's convention (same results after migrating): Sum scales by size,
            scale *= len(ps.ranks)  # Average passes the gathered gradient through
        return (None, None, None, None, None, *[g * scale if scale != 1.0 else g for g in grads])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression=Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each tensor of the list, as one fused unit; differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    outs = _apply(_GroupedReducescatterFunction, name, op, process_set, prescale_factor, postscale_factor,
                  *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# ---- sparse -------------------------------------------------------------------------------------

def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> SparseHandle:
    """Reduce a sparse COO tensor by gathering every rank's indices and values (Sum or Average)."""
    op = horovod_args.check_sum_or_average(op, "sparse_allreduce")
    t = tensor.coalesce()
    indices = t.indices().t().contiguous()
    values = t.values().contiguous()
    handles = [
        collectives.allgather_async(to_host(indices), f"{name}.indices", process_set),
        collectives.allgather_async(to_host(values), f"{name}.values", process_set),
    ]
    count = len(process_set.ranks)

    def finish(results: list[np.ndarray]) -> torch.Tensor:
        all_indices = new_like(results[0]).t()
        all_values = new_like(results[1], tensor)
        if op == Average:
            all_values = all_values / count
        out = torch.sparse_coo_tensor(all_indices.to(tensor.device), all_values, tensor.shape)
        return out.coalesce()

    return SparseHandle(handles, finish)


# ---- control ------------------------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has reached the barrier."""
    collectives.barrier(process_set)


def join(device: int = -1) -> int:
    """This rank has no more data: it contributes zeros until all join. Returns the last rank to join."""
    return collectives.join(device)
