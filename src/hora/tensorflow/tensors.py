"""Running hora's NumPy collectives on TensorFlow tensors: eagerly, inside ``tf.function`` and in
TensorFlow 1 graphs run by a ``tf.compat.v1.Session``; hora.tensorflow's :class:`hora.binding.Adapter`.

Every hora.tensorflow collective is one Python function on NumPy arrays (it submits to the engine
and waits), and most also have a device form on EagerTensors (:mod:`hora.tensorflow.device`: GPU
tensors to NCCL in place, or None when they take the host path). Eagerly, :func:`run_numpy` calls the
device form, else the NumPy one on the tensors' values, at once. While a ``tf.function`` is being
traced the call becomes one op, marked stateful: TensorFlow then never prunes it, and its automatic
control dependencies run such ops in program order, the same order on every rank, so ranks cannot
each block on a different collective. Where TensorFlow has a CUDA device (and ``HORA_NCCL`` is not
off) that op is a ``tf.py_function``: TensorFlow places it on the GPU when its dtypes allow (not
int32), hands its body EagerTensors in GPU memory and takes GPU tensors back, so the same eager
choice runs inside the graph with no host copy. Elsewhere it is a ``tf.numpy_function``, whose body
gets host copies (a CPU kernel only). Shapes that are known statically are set on the outputs so the
rest of the graph keeps its shape information.

A TensorFlow 1 graph has no such control dependencies: its executor runs independent ops in any
order, on a few threads, and the order differs between ranks. Two things follow. An unnamed
collective cannot be named by its place in the order the ranks run collectives, so it gets a name
when the graph is built (:func:`collective_name`), the same on every rank that builds the same
graph. And a collective must not hold one of the executor's threads while it waits for its peers:
with more collectives ready than threads, each rank could fill its threads with collectives the
other ranks have not reached, which they never will. So in such a graph the function runs behind a
``tf.data`` iterator, whose ``IteratorGetNext`` is an asynchronous kernel: it hands the call to a
thread of its own and frees the executor's thread, and every ready collective gets submitted. Such a
graph always takes the host path: the tf.data pipeline runs on the CPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from hora.errors import CollectivePreconditionError, HoraError
from hora.tensorflow import device
from hora.tensorflow.error_types import HoraFailedPreconditionError

SUPPORTED = (tf.uint8, tf.int8, tf.int16, tf.uint16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32,
             tf.float64, tf.bool)

ShapeLike = Any  # tf.TensorShape, a list with None for unknown dimensions, or None (unknown rank)


def check_dtype(tensor: tf.Tensor, what: str = "tensor") -> None:
    """Refuse a dtype the engine lacks when the op is built (or called eagerly), not when it runs."""
    if tensor.dtype not in SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED)
        raise TypeError(f"{what} has dtype {tensor.dtype.name}, which hora does not support; supported: {names}")


def to_tensor(value: Any, what: str = "tensor") -> tf.Tensor:
    """A tf.Tensor for a tensor, a tf.Variable (its current value), a Keras variable or array-like:
    what every collective takes, checked by :func:`check_dtype`."""
    tensor = value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value)
    check_dtype(tensor, what)
    return tensor


def to_host(tensor: tf.Tensor) -> np.ndarray:
    """An EagerTensor's value as NumPy (where TensorFlow allows, a view of its host memory). In a graph
    TensorFlow itself hands the op's body host copies (:func:`run_numpy`)."""
    return tensor.numpy()


def new_like(array: np.ndarray, like: tf.Tensor) -> tf.Tensor:
    """An EagerTensor holding ``array`` with ``like``'s dtype; TensorFlow places it where it is used."""
    return tf.convert_to_tensor(np.asarray(array), dtype=like.dtype)


def write_into(tensor: Any, array: Any) -> Any:
    """Assign ``array`` (a result, or a graph's tensor of it) to ``tensor``, a ``tf.Variable`` or Keras
    variable (TensorFlow's tensors are immutable): the assignment, which is an op in a graph."""
    return tensor.assign(array)


def _refuse_xla() -> None:
    """XLA compiles whole functions and cannot call back into Python: say so instead of failing later."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # private modules moved: let TensorFlow report it at compile time
        return
    if control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise HoraError(
            "hora collectives cannot run inside an XLA-compiled function (jit_compile=True): they call "
            "into Python (tf.numpy_function), which XLA cannot host. Use tf.function(jit_compile=False), "
            "or model.compile(..., jit_compile=False) for Keras")


def graph_mode() -> bool:
    """True while building a TensorFlow 1 graph (for a Session), functions nested in one included.

    Not eagerly, and not in a ``tf.function`` called eagerly: there automatic control dependencies
    keep collectives in program order, and an unnamed one is named when it runs, as eagerly.
    """
    return not tf.executing_eagerly() and not tf.compat.v1.executing_eagerly_outside_functions()


# Per outermost graph: how many collectives of each scope and label it holds (see collective_name).
_NAME_COUNTS: weakref.WeakKeyDictionary[tf.Graph, dict[str, int]] = weakref.WeakKeyDictionary()


def collective_name(name: str | None, label: str) -> str | None:
    """``name``, or for an unnamed collective built in a TensorFlow 1 graph a name fixed now.

    That name is ``label`` in the current name scope, numbered by how many collectives with that
    scope and label the graph has already (``layer/HoraAllreduce``, ``layer/HoraAllreduce_1``...),
    counted in the outermost graph so that functions nested in it (``tf.cond`` branches) share the
    count. Ranks that build the same graph get the same names, whatever order they run it in.
    Elsewhere an unnamed collective stays unnamed (None): it is named when it runs.
    """
    if name is not None or not graph_mode():
        return name
    graph = tf.compat.v1.get_default_graph()
    outermost = graph
    while getattr(outermost, "outer_graph", None) is not None:
        outermost = outermost.outer_graph
    scope = graph.get_name_scope()
    base = f"{scope}/{label}" if scope else label
    counts = _NAME_COUNTS.get(outermost)
    if counts is None:
        counts = _NAME_COUNTS[outermost] = {}
    count = counts.get(base, 0)
    counts[base] = count + 1
    return base if count == 0 else f"{base}_{count}"


def _no_rewrites() -> tf.data.Options:
    """The iterator options of a collective op: tf.data's graph rewrites and autotuning cost more
    than the one-element pipeline they would act on, on every run."""
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.autotune.enabled = False
    return options


def _asynchronous_op(graph_body: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
                     out_dtypes: Sequence[tf.DType], out_shapes: Sequence[ShapeLike]) -> list[tf.Tensor]:
    """``graph_body`` as a one-element ``tf.data`` pipeline read by ``IteratorGetNext`` (see the module
    docstring); a new anonymous iterator each run, so runs share no state."""
    shapes = [tf.TensorShape(s) for s in out_shapes]
    count = len(inputs)
    carried = list(inputs) if inputs else [tf.constant(0, tf.int8)]  # a dataset element needs a component

    def call(*arrays: tf.Tensor) -> tuple:
        outputs = tf.numpy_function(lambda *a: graph_body(*a[:count]), list(arrays), list(out_dtypes),
                                    stateful=True)
        if not isinstance(outputs, (list, tuple)):
            outputs = [outputs]
        for output, shape in zip(outputs, shapes):
            output.set_shape(shape)
        return tuple(outputs)

    # PyFunc and the tf.data kernels are CPU kernels, wherever the caller placed the collective.
    with tf.device("/device:CPU:0"):
        dataset = tf.data.Dataset.from_tensors(tuple(carried)).map(call).with_options(_no_rewrites())
        iterator = tf.raw_ops.AnonymousIteratorV3(output_types=list(out_dtypes), output_shapes=shapes)
        made = tf.raw_ops.MakeIterator(dataset=tf.data.experimental.to_variant(dataset), iterator=iterator)
        with tf.control_dependencies([made]):
            return list(tf.raw_ops.IteratorGetNext(iterator=iterator, output_types=list(out_dtypes),
                                                   output_shapes=shapes))


def _with_horovod_error_types(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` raising a cross-rank disagreement as ``tf.errors.FailedPreconditionError`` (Horovod's
    type; in a graph, see :mod:`hora.tensorflow.error_types`)."""
    def checked(*arrays: Any) -> Any:
        try:
            return body(*arrays)
        except CollectivePreconditionError as error:
            if isinstance(error, HoraFailedPreconditionError):
                raise
            raise HoraFailedPreconditionError.from_hora(error) from None
    return checked


#: A collective's device form: its results as TensorFlow tensors, or None for the host path.
DeviceBody = Callable[..., Sequence[tf.Tensor] | None]


def _eager_call(body: Callable[..., Sequence[np.ndarray]], on_device: DeviceBody | None,
                tensors: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType]) -> list[tf.Tensor]:
    """The collective on EagerTensors: its device form when it takes them, else ``body`` on host copies."""
    if on_device is not None:
        results = on_device(*tensors)
        if results is not None:
            return list(results)
    results = body(*[to_host(t) for t in tensors])
    return [tf.convert_to_tensor(np.asarray(r), dtype=d) for r, d in zip(results, out_dtypes)]


def run_numpy(body: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
              out_dtypes: Sequence[tf.DType], out_shapes: Sequence[ShapeLike], name: str = "hora",
              collective: str | None = None, on_device: DeviceBody | None = None) -> list[tf.Tensor]:
    """``body(*arrays) -> arrays`` on ``inputs``' values, as tensors of ``out_dtypes``.

    Eagerly it runs now (errors are raised here, with their own types); in a graph it is an op that
    runs ``body`` each time the graph runs (errors then surface as ``tf.errors.OpError`` carrying the
    original message), built in name scope ``name``. ``collective``, the name ``body`` gives its
    collective, is recorded on the op as attribute ``_hora_collective`` (for the graph's reader:
    which op is which collective). ``on_device(*tensors)``, the same collective on EagerTensors,
    runs first where given (eagerly, and in a ``tf.function`` staged as a ``tf.py_function``); when
    it returns None ``body`` runs on host copies instead.
    """
    body = _with_horovod_error_types(body)
    device_body = None if on_device is None else _with_horovod_error_types(on_device)
    if tf.executing_eagerly():
        return _eager_call(body, device_body, inputs, out_dtypes)
    _refuse_xla()

    def graph_body(*arrays: np.ndarray) -> list[np.ndarray]:
        # numpy_function wants exactly the declared dtypes back (0-d results as arrays too)
        return [np.asarray(r, dtype=d.as_numpy_dtype) for r, d in zip(body(*arrays), out_dtypes)]

    if graph_mode():
        with tf.name_scope(name):
            outputs = _asynchronous_op(graph_body, inputs, out_dtypes, out_shapes)
    else:
        if device_body is not None and device.stages_on_device():
            outputs = tf.py_function(lambda *ts: _eager_call(body, device_body, ts, out_dtypes), list(inputs),
                                     list(out_dtypes), name=name)
        else:
            outputs = tf.numpy_function(graph_body, list(inputs), list(out_dtypes), stateful=True, name=name)
        if not isinstance(outputs, (list, tuple)):
            outputs = [outputs]
        for output, shape in zip(outputs, out_shapes):
            output.set_shape(shape)
    if collective is not None:
        outputs[0].op._set_attr("_hora_collective", attr_value_pb2.AttrValue(s=collective.encode()))
    return list(outputs)


def leading_unknown(shape: tf.TensorShape) -> ShapeLike:
    """``shape`` with its first dimension unknown (what an allgather or alltoall returns)."""
    if shape.rank is None:
        return None
    if shape.rank == 0:
        return [None]
    return [None] + shape.as_list()[1:]
