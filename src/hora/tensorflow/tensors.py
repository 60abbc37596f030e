"""Running hora's NumPy collectives on TensorFlow tensors, eagerly and inside ``tf.function``.

Every hora.tensorflow collective is one Python function on NumPy arrays (it submits to the engine
and waits). Eagerly, :func:`run_numpy` calls it on the tensors' values at once. While a
``tf.function`` is being traced it becomes one ``tf.numpy_function`` op, marked stateful: TensorFlow
then never prunes it, and its automatic control dependencies run such ops in program order, the
same order on every rank, so ranks cannot each block on a different collective. Shapes that are
known statically are set on the outputs so the rest of the graph keeps its shape information.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from hora.errors import HoraError

SUPPORTED = (tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64,
             tf.bool)

ShapeLike = Any  # tf.TensorShape, a list with None for unknown dimensions, or None (unknown rank)


def to_tensor(value: Any, what: str = "tensor") -> tf.Tensor:
    """A tf.Tensor for a tensor, a tf.Variable (its current value), a Keras variable or array-like."""
    tensor = value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value)
    if tensor.dtype not in SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED)
        raise TypeError(f"{what} has dtype {tensor.dtype.name}, which hora does not support; supported: {names}")
    return tensor


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


def run_numpy(body: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
              out_dtypes: Sequence[tf.DType], out_shapes: Sequence[ShapeLike], name: str = "hora") -> list[tf.Tensor]:
    """``body(*arrays) -> arrays`` on ``inputs``' values, as tensors of ``out_dtypes``.

    Eagerly it runs now (errors are raised here, with their own types); in a graph it is one op that
    runs ``body`` each time the graph runs (errors then surface as ``tf.errors.OpError`` carrying the
    original message).
    """
    if tf.executing_eagerly():
        results = body(*[t.numpy() for t in inputs])
        return [tf.convert_to_tensor(np.asarray(r), dtype=d) for r, d in zip(results, out_dtypes)]
    _refuse_xla()

    def graph_body(*arrays: np.ndarray) -> list[np.ndarray]:
        # numpy_function wants exactly the declared dtypes back (0-d results as arrays too)
        return [np.asarray(r, dtype=d.as_numpy_dtype) for r, d in zip(body(*arrays), out_dtypes)]

    outputs = tf.numpy_function(graph_body, list(inputs), list(out_dtypes), stateful=True, name=name)
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    for output, shape in zip(outputs, out_shapes):
        output.set_shape(shape)
    return list(outputs)


def leading_unknown(shape: tf.TensorShape) -> ShapeLike:
    """``shape`` with its first dimension unknown (what an allgather or alltoall returns)."""
    if shape.rank is None:
        return None
    if shape.rank == 0:
        return [None]
    return [None] + shape.as_list()[1:]
