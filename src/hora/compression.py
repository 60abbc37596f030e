"""Gradient compression for every binding (Horovod's ``Compression`` namespace).

One implementation serves torch tensors, TensorFlow tensors, MXNet NDArrays, the tensors of whichever
Keras backend is active and NumPy arrays, so ``hvd.Compression.fp16`` means the same thing in ``hora.torch``,
``hora.tensorflow`` and ``hora.keras`` on every backend. Importing it imports no framework: the cast
is looked up from the tensor's own type when a tensor arrives (that framework is loaded by then).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.errors import UnsupportedOperationError

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _dtype_name(tensor: Any) -> str:
    """'float32', 'int64', ... for a NumPy array, a torch or tf.Tensor, or a backend tensor."""
    dtype = tensor.dtype
    if isinstance(dtype, type) and issubclass(dtype, np.generic):  # MXNet NDArrays give numpy scalar types
        return np.dtype(dtype).name
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def _cast(tensor: Any, dtype: str) -> Any:
    """``tensor`` as ``dtype``, with the framework that owns it (never importing another one)."""
    if isinstance(tensor, (np.ndarray, np.generic)):
        if dtype == "bfloat16":  # NumPy's own dtypes stop at float16; ml_dtypes (the engine's) has it
            import ml_dtypes

            return np.asarray(tensor).astype(ml_dtypes.bfloat16)
        return np.asarray(tensor).astype(dtype)
    if type(tensor).__module__.startswith("torch"):
        import torch

        return tensor.to(getattr(torch, dtype))
    if type(tensor).__module__.startswith("tensorflow"):
        import tensorflow as tf

        return tf.cast(tensor, dtype)
    if type(tensor).__module__.startswith("mxnet"):
        return tensor.astype(dtype)
    if type(tensor).__module__.startswith(("jax", "jaxlib")):  # jax.Arrays and jit tracers (hora.jax)
        return tensor.astype(dtype)
    import keras  # any other tensor belongs to the active Keras backend

    return keras.ops.cast(tensor, dtype)


class Compressor:
    """Turns a tensor into what travels (``compress``) and back (``decompress``)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Sends wider floating-point tensors as float16, halving (or quartering) the bytes on the wire.

    The context is the original dtype name; integer and float16 tensors travel unchanged.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = _dtype_name(tensor)
        if dtype in _FLOATS and dtype != "float16":
            return _cast(tensor, "float16"), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _cast(tensor, ctx) if ctx is not None else tensor


class BF16Compressor(Compressor):
    """Sends float32 and float64 tensors as bfloat16 (not in Horovod 0.28.1, which has fp16 only).

    The bytes are fp16's, but bfloat16 keeps float32's exponent: a gradient above 65504 or below
    6e-8, which fp16 turns into inf or 0, arrives with its magnitude, at the price of 8 significant
    bits instead of 11. Integers, float16 and bfloat16 travel unchanged. MXNet NDArrays have no
    bfloat16 type, so an MXNet float tensor is refused with that reason before anything is sent.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = _dtype_name(tensor)
        if dtype not in ("float32", "float64"):
            return tensor, None
        if type(tensor).__module__.startswith("mxnet"):
            raise UnsupportedOperationError(
                "Compression.bf16: MXNet NDArrays have no bfloat16 type (astype('bfloat16') is refused); "
                "use Compression.fp16 with MXNet")
        return _cast(tensor, "bfloat16"), dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _cast(tensor, ctx) if ctx is not None else tensor


class Compression:
    """The compressors a collective, DistributedGradientTape or DistributedOptimizer accepts."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
