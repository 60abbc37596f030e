"""Collectives on jax.Arrays, with Horovod's names, arguments and defaults.

Outside ``jax.jit`` (the normal case) an array on one CUDA GPU goes to NCCL in place when NCCL can
carry it (:mod:`hora.jax.device`; ``HORA_NCCL``, as in hora.torch), and the result is a new
jax.Array on that GPU. Any other array is read as NumPy (a GPU array NCCL cannot take is copied
through host memory), submitted to hora's engine through :mod:`hora.collectives`, and the result
comes back where the input lived (:mod:`hora.jax.arrays`). ``_async`` forms return a handle for
:func:`poll` / :func:`synchronize`; the synchronous forms are the async ones, waited for. A group
(``grouped_*``, a pytree) goes one way as a whole: on NCCL when every member can, else through the host.

Inside ``jax.jit`` the operands are tracers, so the synchronous forms stage the collective as one
``jax.experimental.io_callback(..., ordered=True)``: at run time XLA copies the operands to the host,
calls hora's engine and copies the result back. ``ordered=True`` keeps the collectives of one
compiled function in program order on every rank (ranks must agree on the order). The cost is a
host round trip and a synchronisation point per call: group tensors (``grouped_*`` or a pytree) so a
step pays it once. Output shapes must be known when tracing: inside jit, allgather assumes every rank
has the same first dimension and alltoall splits evenly (both check it at run time). jax arrays are
immutable, so Horovod's in-place forms (``allreduce_``, ...) do not exist here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

from hora import basics, collectives, horovod_args
from hora.basics import Average, ProcessSet, global_process_set
from hora.binding import ConvertingHandle, as_is, new_each, new_one, poll as poll, synchronize as synchronize
from hora.compression import Compression
from hora.engine.executor import reducescatter_rows
from hora.engine.request import Handle, Kind, Request
from hora.jax import arrays as adapter, device
from hora.jax.arrays import is_traced, new_like, spec, to_host

HostFn = Callable[[list[np.ndarray]], list[np.ndarray]]


class JaxHandle(ConvertingHandle):
    """What the ``_async`` collectives return: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ()


def _no_tracers(tensors: Sequence[Any], what: str) -> None:
    if any(is_traced(t) for t in tensors):
        raise TypeError(f"hora.jax.{what} cannot run inside jax.jit (a handle cannot leave the compiled "
                        f"function); use the synchronous form, which runs as a host callback there")


def _any_traced(tensors: Sequence[Any]) -> bool:
    return any(is_traced(t) for t in tensors)


def _run(host_fn: HostFn, tensors: Sequence[Any], out_specs: Callable[[], list[jax.ShapeDtypeStruct]]) -> list:
    """``host_fn`` on the tensors' NumPy values in an ordered host callback (under jit: some are tracers)."""
    specs = out_specs()

    def callback(*arrays: Any) -> tuple:
        results = host_fn([np.asarray(a) for a in arrays])
        for result, want in zip(results, specs):
            if tuple(result.shape) != want.shape:
                raise ValueError(f"hora.jax rank {basics.rank()}: inside jax.jit the result must have the shape "
                                 f"fixed when tracing, {want.shape}, got {tuple(result.shape)} (allgather and "
                                 f"alltoall need the same first dimension on every rank there)")
        return tuple(np.asarray(r, dtype=w.dtype) for r, w in zip(results, specs))

    return list(io_callback(callback, tuple(specs), *tensors, ordered=True))


def _compressed(tensors: Sequence[Any], compression) -> tuple[list, list]:
    pairs = [compression.compress(t) for t in tensors]
    return [c for c, _ in pairs], [ctx for _, ctx in pairs]


def _decompressed(outs: Sequence[Any], ctxs: Sequence[Any], compression) -> list:
    return [compression.decompress(o, ctx) for o, ctx in zip(outs, ctxs)]


def _waiter(async_fn: Callable[..., Handle | list[Handle]]) -> HostFn:
    def host_fn(arrays: list[np.ndarray]) -> list[np.ndarray]:
        handles = async_fn(arrays)
        return [collectives.synchronize(h) for h in (handles if isinstance(handles, list) else [handles])]
    return host_fn


# ---- the device path (jax.Arrays on one CUDA GPU, see hora.jax.device) -----------------------------

def _on_device(request: Request | None, finish: Callable[[Any], Any] = as_is) -> JaxHandle | None:
    """The handle of ``request`` submitted to NCCL, or None when it takes the host path."""
    if request is None:
        return None
    return JaxHandle(collectives.submit_requests([request])[0], finish)


def _grouped_on_device(kind: Kind, tensors: Sequence[Any], name: str | None, process_set: ProcessSet,
                       **fields: Any) -> JaxHandle | None:
    """A grouped collective on NCCL when every member is a CUDA array NCCL can carry, else None (then
    every member takes the host path, so that the group stays one unit)."""
    if not tensors or not all(device.is_cuda(t) for t in tensors):
        return None
    base, names = collectives.group_names(name, len(tensors), kind.value.lower(), process_set)
    requests = [device.cuda_request(kind, t, n, process_set, group=base, group_size=len(tensors), **fields)
                for t, n in zip(tensors, names)]
    ready = [r for r in requests if r is not None]
    if len(ready) < len(requests):
        return None
    return JaxHandle(collectives.submit_requests(ready), list)


# ---- allreduce ----------------------------------------------------------------------------------

def allreduce(tensor: Any, average: bool | None = None, name: str | None = None, compression=Compression.none,
              op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce across ranks (Average by default). ``tensor`` may be a pytree: its leaves are reduced as
    one fused group and the same tree comes back. Works inside jax.jit."""
    leaves, tree = jax.tree_util.tree_flatten(tensor)
    if tree.num_leaves == 1 and tree.num_nodes == 1:
        sent, ctxs = _compressed(leaves, compression)
        if not is_traced(sent[0]):
            out = [synchronize(allreduce_async(sent[0], average, name, op, prescale_factor, postscale_factor,
                                               process_set))]
        else:
            host_fn = _waiter(lambda a: collectives.allreduce_async(a[0], average, name, op, prescale_factor,
                                                                    postscale_factor, process_set))
            out = _run(host_fn, sent, lambda: [spec(sent[0])])
        return _decompressed(out, ctxs, compression)[0]
    out = grouped_allreduce(leaves, average, name, compression, op, prescale_factor, postscale_factor, process_set)
    return jax.tree_util.tree_unflatten(tree, out)


def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Start reducing ``tensor``; :func:`synchronize` returns a new jax.Array (outside jit only)."""
    _no_tracers([tensor], "allreduce_async")
    op = horovod_args.resolve_op(op, average)
    handle = _on_device(device.cuda_request(Kind.ALLREDUCE, tensor, name, process_set, op=op,
                                            prescale=prescale_factor, postscale=postscale_factor))
    if handle is not None:
        return handle
    inner = collectives.allreduce_async(to_host(tensor), None, name, op, prescale_factor, postscale_factor,
                                        process_set)
    return JaxHandle(inner, new_one(adapter, tensor))


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                      compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    """Reduce a list of arrays as one fused unit (one host callback inside jit)."""
    if not tensors:
        return []
    sent, ctxs = _compressed(tensors, compression)
    if not _any_traced(sent):
        out = synchronize(grouped_allreduce_async(sent, average, name, op, prescale_factor, postscale_factor,
                                                  process_set))
    else:
        host_fn = _waiter(lambda a: collectives.grouped_allreduce_async(a, average, name, op, prescale_factor,
                                                                        postscale_factor, process_set))
        out = _run(host_fn, sent, lambda: [spec(t) for t in sent])
    return _decompressed(out, ctxs, compression)


def grouped_allreduce_async(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> JaxHandle:
    _no_tracers(tensors, "grouped_allreduce_async")
    op = horovod_args.resolve_op(op, average)
    handle = _grouped_on_device(Kind.ALLREDUCE, tensors, name, process_set, op=op, prescale=prescale_factor,
                                postscale=postscale_factor)
    if handle is not None:
        return handle
    handles = collectives.grouped_allreduce_async([to_host(t) for t in tensors], None, name, op,
                                                  prescale_factor, postscale_factor, process_set)
    return JaxHandle(handles, new_each(adapter, tensors))


# ---- allgather ----------------------------------------------------------------------------------

def _gathered_spec(t: Any, process_set: ProcessSet) -> jax.ShapeDtypeStruct:
    shape = tuple(t.shape)
    first = shape[0] if shape else 1
    return spec(t, (first * process_set.size(), *shape[1:]))


def _equal_rows_gather(name: str | None, process_set: ProcessSet) -> HostFn:
    """Allgather for inside jit, where the output shape assumed every rank has the same first
    dimension: each rank's first dimension travels in the same fused request, so every rank sees a
    difference and fails with the same error (a shape check alone can pass on some ranks)."""
    def host_fn(arrays: list[np.ndarray]) -> list[np.ndarray]:
        rows = [np.array([a.shape[0] if a.ndim else 1], dtype=np.int64) for a in arrays]
        handles = collectives.grouped_allgather_async([*arrays, *rows], name, process_set)
        results = [collectives.synchronize(h) for h in handles]
        gathered, counts = results[:len(arrays)], results[len(arrays):]
        for count in counts:
            if len(set(count.tolist())) > 1:
                raise ValueError(f"hora.jax rank {basics.rank()}: inside jax.jit, allgather needs the same first "
                                 f"dimension on every rank (the output shape is fixed when tracing); the ranks of "
                                 f"the process set have {count.tolist()}. Call it outside jit for ragged inputs")
        return gathered
    return host_fn


def _rows(tensor: Any) -> Any:
    """A scalar gathers as one row (as on the host path); the device path needs that shape up front."""
    return tensor.reshape(1) if device.is_cuda(tensor) and tensor.ndim == 0 else tensor


def allgather(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's array along dimension 0 (first dimensions may differ outside jit)."""
    if is_traced(tensor):
        return _run(_equal_rows_gather(name, process_set), [tensor], lambda: [_gathered_spec(tensor, process_set)])[0]
    return synchronize(allgather_async(tensor, name, process_set))


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    _no_tracers([tensor], "allgather_async")
    handle = _on_device(device.cuda_request(Kind.ALLGATHER, _rows(tensor), name, process_set))
    if handle is not None:
        return handle
    inner = collectives.allgather_async(to_host(tensor), name, process_set)
    return JaxHandle(inner, new_one(adapter, tensor))


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list:
    if _any_traced(tensors):
        return _run(_equal_rows_gather(name, process_set), tensors,
                    lambda: [_gathered_spec(t, process_set) for t in tensors])
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> JaxHandle:
    _no_tracers(tensors, "grouped_allgather_async")
    handle = _grouped_on_device(Kind.ALLGATHER, [_rows(t) for t in tensors], name, process_set)
    if handle is not None:
        return handle
    handles = collectives.grouped_allgather_async([to_host(t) for t in tensors], name, process_set)
    return JaxHandle(handles, new_each(adapter, tensors))


# ---- broadcast ----------------------------------------------------------------------------------

def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s array on every rank (a new array: jax arrays are immutable)."""
    if not is_traced(tensor):
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))
    host_fn = _waiter(lambda a: collectives.broadcast_async(a[0], root_rank, name, process_set))
    return _run(host_fn, [tensor], lambda: [spec(tensor)])[0]


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    _no_tracers([tensor], "broadcast_async")
    if device.is_cuda(tensor):
        collectives.check_root(root_rank, process_set)
        handle = _on_device(device.cuda_request(Kind.BROADCAST, tensor, name, process_set, root=int(root_rank)))
        if handle is not None:
            return handle
    inner = collectives.broadcast_async(to_host(tensor), root_rank, name, process_set)
    return JaxHandle(inner, new_one(adapter, tensor))


# ---- alltoall -----------------------------------------------------------------------------------

def _splits(splits: Any) -> Any:
    return None if splits is None else np.asarray(splits)


def _received(received: Any) -> jax.Array:
    return new_like(np.asarray(received, dtype=np.int32))


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows to rank j; returns the output, or ``(output, received_splits)`` with
    splits. Inside jit only even splits (``splits=None``) are possible: shapes are fixed there."""
    if is_traced(tensor) and splits is not None:
        raise TypeError("hora.jax.alltoall inside jax.jit takes splits=None (even splits): the output shape "
                        "must be known when tracing")
    if not is_traced(tensor):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        return output if splits is None else (output, received)

    def host_fn(arrays: list[np.ndarray]) -> list[np.ndarray]:
        rows = collectives.allgather(np.array([arrays[0].shape[0]], dtype=np.int64), None, process_set)
        if len(set(rows.tolist())) > 1:  # checked on every rank before any row moves
            raise ValueError(f"hora.jax rank {basics.rank()}: inside jax.jit, alltoall needs the same first "
                             f"dimension on every rank (the output shape is fixed when tracing); the "
                             f"ranks have {rows.tolist()}")
        return [collectives.alltoall(arrays[0], None, name, process_set)]

    return _run(host_fn, [tensor], lambda: [spec(tensor)])[0]


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Start an alltoall; :func:`synchronize` returns ``(output, received_splits)``."""
    _no_tracers([tensor], "alltoall_async")
    if device.is_cuda(tensor):
        split_list = collectives.alltoall_splits(tuple(tensor.shape), _splits(splits), process_set)
        request = device.cuda_request(Kind.ALLTOALL, tensor, name, process_set, splits=tuple(split_list))
        handle = _on_device(request, lambda r: (r[0], _received(r[1])))
        if handle is not None:
            return handle
    inner = collectives.alltoall_async(to_host(tensor), _splits(splits), name, process_set)
    return JaxHandle(inner, lambda r: (new_like(r[0], tensor), _received(r[1])))


# ---- reducescatter ------------------------------------------------------------------------------

def _scattered_spec(t: Any, process_set: ProcessSet) -> jax.ShapeDtypeStruct:
    shape = tuple(t.shape)
    rows = reducescatter_rows(shape[0], process_set.size())[process_set.rank()]
    return spec(t, (rows, *shape[1:]))


def _scatterable(tensors: Sequence[Any]) -> bool:
    """Whether the device path may take them: a scalar has no rows (the host path says so)."""
    return all(getattr(t, "ndim", 0) > 0 for t in tensors)


def reducescatter(tensor: Any, name: str | None = None, compression=Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce across ranks and keep this rank's block of rows (the first ``rows % size`` ranks get one more)."""
    sent, ctxs = _compressed([tensor], compression)
    if not is_traced(sent[0]):
        out = [synchronize(reducescatter_async(sent[0], name, op, process_set, prescale_factor, postscale_factor))]
    else:
        host_fn = _waiter(lambda a: collectives.reducescatter_async(a[0], name, op, process_set, prescale_factor,
                                                                    postscale_factor))
        out = _run(host_fn, sent, lambda: [_scattered_spec(sent[0], process_set)])
    return _decompressed(out, ctxs, compression)[0]


def reducescatter_async(tensor: Any, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> JaxHandle:
    _no_tracers([tensor], "reducescatter_async")
    if _scatterable([tensor]):
        op = horovod_args.check_sum_or_average(op, "reducescatter")
        handle = _on_device(device.cuda_request(Kind.REDUCESCATTER, tensor, name, process_set, op=op,
                                                prescale=prescale_factor, postscale=postscale_factor))
        if handle is not None:
            return handle
    inner = collectives.reducescatter_async(to_host(tensor), name, op, process_set, prescale_factor,
                                            postscale_factor)
    return JaxHandle(inner, new_one(adapter, tensor))


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None, compression=Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    sent, ctxs = _compressed(tensors, compression)
    if not _any_traced(sent):
        out = synchronize(grouped_reducescatter_async(sent, name, op, process_set, prescale_factor,
                                                      postscale_factor))
    else:
        host_fn = _waiter(lambda a: collectives.grouped_reducescatter_async(a, name, op, process_set,
                                                                            prescale_factor, postscale_factor))
        out = _run(host_fn, sent, lambda: [_scattered_spec(t, process_set) for t in sent])
    return _decompressed(out, ctxs, compression)


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> JaxHandle:
    _no_tracers(tensors, "grouped_reducescatter_async")
    if _scatterable(tensors):
        op = horovod_args.check_sum_or_average(op, "reducescatter")
        handle = _grouped_on_device(Kind.REDUCESCATTER, tensors, name, process_set, op=op,
                                    prescale=prescale_factor, postscale=postscale_factor)
        if handle is not None:
            return handle
    handles = collectives.grouped_reducescatter_async([to_host(t) for t in tensors], name, op, process_set,
                                                      prescale_factor, postscale_factor)
    return JaxHandle(handles, new_each(adapter, tensors))


# ---- control ------------------------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has reached the barrier."""
    collectives.barrier(process_set)


def join(device: int = -1) -> int:
    """This rank has no more data: it contributes zeros until all join. Returns the last rank to join."""
    return collectives.join(device)
