"""Collectives on TensorFlow tensors, with horovod.tensorflow's names, signatures and defaults.

Each works eagerly and inside ``tf.function`` (see :mod:`hora.tensorflow.tensors`), takes a
``tf.Tensor``, a ``tf.Variable`` (its value) or anything ``tf.convert_to_tensor`` accepts, and is
differentiable with Horovod's gradients: allreduce reduces the upstream gradient with the same op
and scale factors; allgather and broadcast average it across ranks (broadcast keeps it on the root
only, allgather keeps this rank's rows); alltoall sends it back whence the rows came; reducescatter
gathers it, scaled by the set size for Sum. ``name=None`` names a collective by its place in the
sequence of unnamed collectives, so ranks must then issue them in the same order (a ``tf.function``
runs them in program order); in a TensorFlow 1 graph, whose Session runs ops in any order, it is
named when the graph is built instead, from its name scope (see
:func:`hora.tensorflow.tensors.collective_name`), and each op records its name in attribute
``_hora_collective``. ``device_*`` place the surrounding TensorFlow ops, as in Horovod;
``ignore_name_scope`` is accepted and has no effect (a name given is used as it is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora import basics, collectives
from hora.basics import Average, ProcessSet, Sum, global_process_set
from hora.binding import batched
from hora.compression import Compression
from hora.engine.request import Kind
from hora.horovod_args import GradientReduction, check_sum_or_average, resolve_op
from hora.tensorflow import device
from hora.tensorflow.gradients import allreduce_list
from hora.tensorflow.tensors import collective_name, graph_mode, leading_unknown, run_numpy, to_tensor, write_into


def _upstream(dy: tf.Tensor | None, like: tf.Tensor) -> tf.Tensor:
    """The gradient arriving at an output, zeros when that output did not reach the loss."""
    return tf.zeros_like(like) if dy is None else tf.convert_to_tensor(dy)


def _compressed(tensors: Sequence[Any], device: str, compression,
                reduce: Callable[[list[tf.Tensor]], list[tf.Tensor]]) -> list[tf.Tensor]:
    """``reduce`` the compressed tensors on ``device``; the results decompressed."""
    with tf.device(device):
        pairs = [compression.compress(to_tensor(t)) for t in tensors]
        outputs = reduce([c for c, _ in pairs])
        return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outputs, pairs)]


# ---- allreduce ----------------------------------------------------------------------------------

def _allreduce_many(tensors: Sequence[tf.Tensor], name: str | None, op: int, pre: float, post: float,
                    process_set: ProcessSet, grouped: bool) -> list[tf.Tensor]:
    """Reduce tensors in one op: as one fused unit (``grouped``) or as separate requests."""
    label = "HoraGroupedAllreduce" if grouped else "HoraAllreduce"
    name = collective_name(name, label)

    @tf.custom_gradient
    def forward(*xs):
        def body(*arrays):
            if grouped:
                return collectives.grouped_allreduce(list(arrays), None, name, op, pre, post, process_set)
            return [collectives.allreduce(arrays[0], None, name, op, pre, post, process_set)]

        def on_device(*tensors):
            return device.allreduce(tensors, name, op, pre, post, process_set, grouped)

        ys = run_numpy(body, xs, [x.dtype for x in xs], [x.shape for x in xs], name=label, collective=name,
                       on_device=on_device)

        def grad(*dys):
            return _allreduce_many([_upstream(d, x) for d, x in zip(dys, xs)], None, op, pre, post, process_set,
                                   grouped)

        return ys, grad

    return list(forward(*tensors))


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` across ranks (Average by default); an IndexedSlices is gathered instead."""
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        reduction = GradientReduction(op, float(prescale_factor), float(postscale_factor), process_set)
        return allreduce_list([tensor], [name], reduction, device_sparse=device_sparse)[0]
    return _compressed([tensor], device_dense, compression, lambda xs: _allreduce_many(
        xs, name, op, prescale_factor, postscale_factor, process_set, False))[0]


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression=Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list:
    """Reduce a list of tensors as one fused unit (negotiated and sent together).

    The list may mix dense tensors and ``tf.IndexedSlices``, as in Horovod: the dense ones are
    compressed and reduced together; each IndexedSlices comes back as an IndexedSlices holding every
    rank's values and indices (values divided by the set size for Average; Sum and Average only).
    """
    op = resolve_op(op, average)
    tensors = list(tensors)
    if not tensors:
        return []
    sparse_at = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense_at = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    result: list = [None] * len(tensors)
    if sparse_at:
        reduction = GradientReduction(op, float(prescale_factor), float(postscale_factor), process_set)
        reduction.sparse_scale()  # refuses other ops here, before any rank starts a collective
    if dense_at:
        reduced = _compressed([tensors[i] for i in dense_at], device_dense, compression, lambda xs: _allreduce_many(
            xs, name, op, prescale_factor, postscale_factor, process_set, True))
        for i, t in zip(dense_at, reduced):
            result[i] = t
    if sparse_at:
        names = [None if name is None else f"{name}.sparse.{k}" for k in range(len(sparse_at))]
        # The dense op first, then the sparse one: a TensorFlow 1 graph has no automatic control
        # dependencies, and unnamed collectives must run in the same order on every rank.
        after = [result[i] for i in dense_at] if not tf.executing_eagerly() else []
        with tf.control_dependencies(after):
            gathered = allreduce_list([tensors[i] for i in sparse_at], names, reduction, device_sparse=device_sparse)
        for i, t in zip(sparse_at, gathered):
            result[i] = t
    return result


# ---- allgather ----------------------------------------------------------------------------------

def _gather_grad(dys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], process_set: ProcessSet) -> list[tf.Tensor]:
    """Horovod's allgather gradient: average the upstream gradients, keep this rank's rows."""
    rows = [tf.shape(x)[:1] if x.shape.rank else tf.constant([1]) for x in xs]
    name = collective_name(None, "HoraAllgatherGrad")
    averaged, dims_name = (f"{name}.average", f"{name}.rows") if name is not None else (None, None)

    def body(*arrays):
        half = len(arrays) // 2
        summed = collectives.grouped_allreduce(list(arrays[:half]), name=averaged, op=Average,
                                               process_set=process_set)
        dims = collectives.allgather(np.concatenate([np.asarray(a, np.int64).reshape(1) for a in arrays[half:]])
                                     .reshape(1, -1), name=dims_name, process_set=process_set)
        me = process_set.ranks.index(basics.rank())
        offsets = dims[:me].sum(0)
        return [g[o:o + int(n)] for g, o, n in zip(summed, offsets, dims[me])]

    grads = run_numpy(body, list(dys) + rows, [d.dtype for d in dys], [leading_unknown(x.shape) for x in xs],
                      name="HoraAllgatherGrad", collective=name)
    return [tf.reshape(g, tf.shape(x)) for g, x in zip(grads, xs)]


def _allgather_many(tensors: Sequence[tf.Tensor], name: str | None, process_set: ProcessSet,
                    grouped: bool) -> list[tf.Tensor]:
    label = "HoraGroupedAllgather" if grouped else "HoraAllgather"
    name = collective_name(name, label)

    @tf.custom_gradient
    def forward(*xs):
        def body(*arrays):
            if grouped:
                return collectives.grouped_allgather(list(arrays), name, process_set)
            return [collectives.allgather(arrays[0], name, process_set)]

        def on_device(*tensors):
            return device.allgather(tensors, name, process_set, grouped)

        ys = run_numpy(body, xs, [x.dtype for x in xs], [leading_unknown(x.shape) for x in xs], name=label,
                       collective=name, on_device=on_device)

        def grad(*dys):
            return _gather_grad([_upstream(d, y) for d, y in zip(dys, ys)], xs, process_set)

        return ys, grad

    return list(forward(*tensors))


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along the first dimension (first dimensions may differ)."""
    return _allgather_many([to_tensor(tensor)], name, process_set, False)[0]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather each tensor of the list, as one fused unit."""
    tensors = [to_tensor(t) for t in tensors]
    return _allgather_many(tensors, name, process_set, True) if tensors else []


# ---- broadcast ----------------------------------------------------------------------------------

def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s tensor on every rank (``root_rank`` is a global rank)."""
    name = collective_name(name, "HoraBroadcast")

    @tf.custom_gradient
    def forward(x):
        y = run_numpy(lambda a: [collectives.broadcast(a, root_rank, name, process_set)], [x], [x.dtype], [x.shape],
                      name="HoraBroadcast", collective=name,
                      on_device=lambda t: device.broadcast(t, root_rank, name, process_set))[0]

        def grad(dy):
            averaged = _allreduce_many([_upstream(dy, y)], None, Average, 1.0, 1.0, process_set, False)[0]
            return averaged if basics.rank() == root_rank else averaged * 0

        return y, grad

    return forward(to_tensor(tensor))


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list:
    """Overwrite each variable with ``root_rank``'s value, in place.

    Eagerly and inside ``tf.function`` the assignments are done (or run by automatic control
    dependencies) and the variables are returned. In a TensorFlow 1 graph nothing runs until a
    Session runs it, so, as in Horovod, it returns the updated values: tensors whose evaluation
    broadcasts and assigns, then reads the variable.
    """
    variables = list(variables)
    assignments = assign_from_root(variables, root_rank, name, process_set)
    if not graph_mode():
        return variables
    return [tf.identity(a) for a in assignments]


def assign_from_root(variables: Sequence[Any], root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Assign ``root_rank``'s value to each variable (one engine round); the assignments.

    Inside ``tf.function`` automatic control dependencies run them; in a TensorFlow 1 graph the
    caller groups them into the op it hands to ``Session.run``.
    """
    variables = list(variables)
    if not variables:
        return []
    values = [to_tensor(v, "variable") for v in variables]
    name = collective_name(name, "HoraBroadcastInplace")

    def body(*arrays):
        return batched.broadcast_arrays(arrays, root_rank, process_set, name)

    results = run_numpy(body, values, [v.dtype for v in values], [v.shape for v in values], name="HoraBroadcastInplace",
                        collective=name)
    return [write_into(variable, result) for variable, result in zip(variables, results)]


# ---- alltoall -----------------------------------------------------------------------------------

def _alltoall(x: tf.Tensor, splits: tf.Tensor | None, name: str | None, process_set: ProcessSet):
    inputs = [x] if splits is None else [x, tf.cast(splits, tf.int64)]
    name = collective_name(name, "HoraAlltoall")

    def body(array, split_array=None):
        output, received = collectives.alltoall_async(array, split_array, name, process_set).wait()
        return [output, np.asarray(received, np.int64)]

    # The received counts travel as int64 and are cast after: a tf.py_function with an int32 output
    # has no GPU kernel, so TensorFlow would run it on the CPU, with host copies of the rows.
    shapes = [leading_unknown(x.shape), [len(process_set.ranks)]]
    output, received = run_numpy(body, inputs, [x.dtype, tf.int64], shapes, name="HoraAlltoall", collective=name,
                                 on_device=lambda t, s=None: device.alltoall(t, s, name, process_set))
    return output, tf.cast(received, tf.int32)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows to rank j (equal shares without ``splits``).

    Returns the received rows, or ``(output, received_splits)`` when ``splits`` is given, where
    ``received_splits[j]`` rows came from rank j.
    """
    split_tensor = None if splits is None else tf.convert_to_tensor(splits)

    @tf.custom_gradient
    def forward(x):
        output, received = _alltoall(x, split_tensor, name, process_set)

        def grad(dy, _dreceived=None):
            back, _ = _alltoall(_upstream(dy, output), received, None, process_set)
            return tf.reshape(back, tf.shape(x))

        return (output, received), grad

    output, received = forward(to_tensor(tensor))
    return output if splits is None else (output, received)


# ---- reducescatter ------------------------------------------------------------------------------

def _scatter_shape(x: tf.Tensor, process_set: ProcessSet) -> Any:
    rows = x.shape[0] if x.shape.rank else None
    count = len(process_set.ranks)
    if rows is not None and rows % count == 0:
        return [rows // count] + x.shape.as_list()[1:]
    return leading_unknown(x.shape)


def _reducescatter_many(tensors: Sequence[tf.Tensor], name: str | None, op: int, process_set: ProcessSet,
                        pre: float, post: float, grouped: bool) -> list[tf.Tensor]:
    label = "HoraGroupedReducescatter" if grouped else "HoraReducescatter"
    name = collective_name(name, label)

    @tf.custom_gradient
    def forward(*xs):
        def body(*arrays):
            if grouped:
                return collectives.grouped_reducescatter(list(arrays), name, op, process_set, pre, post)
            return [collectives.reducescatter(arrays[0], name, op, process_set, pre, post)]

        def on_device(*tensors):
            return device.reducescatter(tensors, name, op, pre, post, process_set, grouped)

        ys = run_numpy(body, xs, [x.dtype for x in xs], [_scatter_shape(x, process_set) for x in xs],
                       name=label, collective=name, on_device=on_device)

        def grad(*dys):
            # Horovod's convention: gather the blocks' gradients, scaled as the forward pass scaled
            # (times the set size for Sum; Average passes them through).
            scale = pre * post * (len(process_set.ranks) if op == Sum else 1)
            gathered = _allgather_many([_upstream(d, y) for d, y in zip(dys, ys)], None, process_set, grouped)
            return [tf.reshape(g * tf.cast(scale, g.dtype) if scale != 1.0 else g, tf.shape(x))
                    for g, x in zip(gathered, xs)]

        return ys, grad

    return list(forward(*tensors))


def reducescatter(tensor: Any, device_dense: str = "", compression=Compression.none, op: int = Average,
                  name: str | None = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce across ranks (Sum or Average) and keep this rank's block of rows."""
    op = check_sum_or_average(op, "reducescatter")  # here too, so that tracing fails rather than the first run
    return _compressed([tensor], device_dense, compression, lambda xs: _reducescatter_many(
        xs, name, op, process_set, prescale_factor, postscale_factor, False))[0]


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression=Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: str | None = None) -> list[tf.Tensor]:
    """Reducescatter each tensor of the list, as one fused unit."""
    op = check_sum_or_average(op, "reducescatter")
    tensors = list(tensors)
    if not tensors:
        return []
    return _compressed(tensors, device_dense, compression, lambda xs: _reducescatter_many(
        xs, name, op, process_set, prescale_factor, postscale_factor, True))


# ---- control and topology as ops ----------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> tf.Tensor | None:
    """Return once every rank of the process set has reached the barrier (an op in a graph)."""
    if tf.executing_eagerly():
        collectives.barrier(process_set)
        return None
    name = collective_name(None, "HoraBarrier")

    def body():
        if name is None:
            collectives.barrier(process_set)
        else:
            collectives.synchronize(basics.submit_control(Kind.BARRIER, name, process_set))
        return [np.int32(0)]

    return run_numpy(body, [], [tf.int32], [[]], name="HoraBarrier", collective=name)[0]


def join() -> tf.Tensor:
    """This rank has no more data: it contributes zeros until all join. Returns the last rank to join."""
    return run_numpy(lambda: [np.int32(collectives.join())], [], [tf.int32], [[]], name="HoraJoin")[0]


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of a process set) as a tensor."""
    return tf.constant(_set_by_id(process_set_id).size() if process_set_id else basics.size(), name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(basics.local_size(), name=name)


def rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(basics.rank(), name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(basics.local_rank(), name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 when this rank belongs to the process set, else 0."""
    included = _set_by_id(process_set_id).included() if process_set_id else True
    return tf.constant(int(included), name=name)


def _set_by_id(process_set_id: int) -> ProcessSet:
    ps = basics._ctx.process_sets.get(process_set_id)
    if ps is None:
        raise ValueError(f"no registered process set has id {process_set_id}")
    return ps
