"""Gradient compression for every binding (Horovod's ``Compression`` namespace).

One implementation serves torch tensors, TensorFlow tensors, MXNet NDArrays, the tensors of whichever
Keras backend is active and NumPy arrays, so ``hvd.Compression.fp16`` means the same thing in ``hora.torch``,
``hora.tensorflow`` and ``hora.keras`` on every backend. Importing it imports no framework: the cast
is looked up from the tensor's own type when a tensor arrives (that framework is loaded by then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from hora import config
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


class _CastCompressor(Compressor):
    """A compressor that sends a narrower dtype: its context is the original dtype name, or None
    for a tensor that travelled unchanged."""

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _cast(tensor, ctx) if ctx is not None else tensor


class FP16Compressor(_CastCompressor):
    """Sends wider floating-point tensors as float16, halving (or quartering) the bytes on the wire.

    Integer and float16 tensors travel unchanged.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = _dtype_name(tensor)
        if dtype in _FLOATS and dtype != "float16":
            return _cast(tensor, "float16"), dtype
        return tensor, None


class BF16Compressor(_CastCompressor):
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


class StatefulCompressionSpec:
    """What ``Compression.powersgd(...)`` and ``Compression.topk(...)`` return: an algorithm's options,
    not a compressor.

    These algorithms keep per-parameter state between steps (each rank's residual for error feedback,
    and PowerSGD's shared factors), which a stateless ``compress``/``decompress`` pair cannot hold, so
    the spec only describes the algorithm; the optimizer that owns the state (a reducer inside
    ``hora.torch.DistributedOptimizer``) runs it. The spec still has ``compress``/``decompress``,
    which refuse: every binding's plain collective calls ``compression.compress(tensor)`` before it
    submits anything, so that one method is where every collective in every framework refuses it,
    with the same message, before a byte is sent.
    """

    #: The state the algorithm keeps between steps, as its refusal names it.
    state_kept: ClassVar[str]

    def refusal(self, where: str) -> str:
        """The one-line reason ``where`` (a plain collective, another binding's optimizer) cannot run it."""
        return (f"{self!r} cannot run in {where}: it keeps per-parameter state between steps "
                f"({self.state_kept}), which only an optimizer holds; pass it to "
                "hora.torch.DistributedOptimizer(..., compression=...)")

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        raise UnsupportedOperationError(self.refusal("a plain collective (allreduce, grouped_allreduce, ...)"))

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        raise UnsupportedOperationError(self.refusal("a plain collective (allreduce, grouped_allreduce, ...)"))


@dataclass(frozen=True)
class PowerSGDSpec(StatefulCompressionSpec):
    """What ``Compression.powersgd(...)`` returns: the options of PowerSGD (Vogels et al., 2019), not
    a compressor.

    PowerSGD replaces each matrix-shaped gradient by a low-rank approximation computed jointly by all
    ranks, and keeps per-parameter state between steps (each rank's residual for error feedback, and
    the shared factor Q it warm-starts from); ``hora.torch.powersgd.PowerSGDReducer`` inside
    ``hora.torch.DistributedOptimizer`` runs it.

    Frozen (and so hashable and comparable): two optimizers built from equal specs run the same algorithm,
    and a spec can be a dict key or a default argument.
    """

    #: The rank r of each approximation P Q^T (DDP's ``matrix_approximation_rank``), capped per
    #: matrix at min(rows, columns).
    rank: int = 4
    #: Steps reduced by plain allreduce before compression starts (DDP's ``start_powerSGD_iter``):
    #: compressing the first, fast-changing gradients costs accuracy that later steps do not recover.
    start_iter: int = 1000
    #: A matrix of n x m is compressed only when (n + m) * r * min_compression_rate < n * m.
    min_compression_rate: float = 2.0
    #: Carry each rank's residual (what the approximation missed) into its next step's gradient.
    use_error_feedback: bool = True
    #: Start each step's power iteration from the previous step's Q instead of a fresh random one.
    warm_start: bool = True
    #: An orthogonalized column whose norm is at most this becomes zero instead of being divided by
    #: its norm (0: only exactly-zero columns, which would otherwise give NaN).
    orthogonalization_epsilon: float = 0.0
    #: Seed of the random initial Q; every rank uses it, so every rank starts from the same Q.
    random_seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"Compression.powersgd: rank must be an int of at least 1, got {self.rank!r}")
        if isinstance(self.start_iter, bool) or not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise ValueError(f"Compression.powersgd: start_iter must be an int of at least 0, got {self.start_iter!r}")
        if not float(self.min_compression_rate) >= 0:
            raise ValueError(f"Compression.powersgd: min_compression_rate must be at least 0, "
                             f"got {self.min_compression_rate!r}")
        if not float(self.orthogonalization_epsilon) >= 0:
            raise ValueError(f"Compression.powersgd: orthogonalization_epsilon must be at least 0, "
                             f"got {self.orthogonalization_epsilon!r}")
        if isinstance(self.random_seed, bool) or not isinstance(self.random_seed, int):
            raise ValueError(f"Compression.powersgd: random_seed must be an int, got {self.random_seed!r}")

    def __repr__(self) -> str:
        return f"Compression.powersgd(rank={self.rank}, start_iter={self.start_iter})"

    state_kept: ClassVar[str] = "error feedback, the warm-start factor"


@dataclass(frozen=True)
class TopKSpec(StatefulCompressionSpec):
    """What ``Compression.topk(...)`` returns: top-k sparsification with error feedback.

    Each rank sends, for each gradient, only its ``ratio`` share of elements largest in magnitude
    (values and their positions, gathered by one grouped allgather), and keeps what it did not send
    in a residual added to its next step's gradient (Stich et al., 2018; Lin et al., 2018), so over
    many steps every element's contribution arrives. Every rank then writes the same average of the
    sparse contributions into its gradient. A gradient too small to gain under
    ``min_compression_rate`` goes through one plain allreduce instead.
    """

    #: The share of each gradient's elements a rank sends: k = ceil(ratio * numel), at least 1.
    ratio: float = 0.01
    #: Carry each rank's residual (what it did not send) into its next step's gradient.
    use_error_feedback: bool = True
    #: A gradient is sparsified only when k * (element + 8-byte index) * min_compression_rate is
    #: below its dense bytes; otherwise the dense allreduce costs less.
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ValueError(f"Compression.topk: ratio must be a number in (0, 1], got {self.ratio!r}")
        if not float(self.min_compression_rate) >= 0:
            raise ValueError(f"Compression.topk: min_compression_rate must be at least 0, "
                             f"got {self.min_compression_rate!r}")

    def __repr__(self) -> str:
        return f"Compression.topk(ratio={self.ratio})"

    state_kept: ClassVar[str] = "each rank's error-feedback residual"


def topk(ratio: float = 0.01, use_error_feedback: bool = True, min_compression_rate: float = 2.0) -> TopKSpec:
    """Top-k sparsification's options (see :class:`TopKSpec`); its state lives in the optimizer."""
    return TopKSpec(ratio, use_error_feedback, min_compression_rate)


def powersgd(rank: int = 4, start_iter: int = 1000, min_compression_rate: float = 2.0,
             use_error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
             random_seed: int = 0) -> PowerSGDSpec:
    """PowerSGD's options (see :class:`PowerSGDSpec`); a function, not a compressor class, because
    the algorithm has parameters and its state lives in the optimizer that is given the result."""
    return PowerSGDSpec(rank, start_iter, min_compression_rate, use_error_feedback, warm_start,
                        orthogonalization_epsilon, random_seed)


def parse_compression(text: str) -> Any:
    """``HORA_COMPRESSION``'s (and ``hora run --compression``'s) text as what ``compression=`` takes.

    ``none``, ``fp16`` and ``bf16`` give :class:`NoneCompressor`, :class:`FP16Compressor` and
    :class:`BF16Compressor`; ``powersgd[:RANK[:START_ITER]]`` gives ``powersgd(rank=RANK,
    start_iter=START_ITER)`` and ``topk[:RATIO]`` gives ``topk(ratio=RATIO)`` (the defaults for what
    is left out). The grammar is the knob's, in :mod:`hora.config`; anything else is a ValueError
    that lists the accepted forms.
    """
    name, *numbers = config.knob("compression").parse(text).split(":")
    if name == "topk":
        return topk(ratio=float(numbers[0])) if numbers else topk()
    if name == "powersgd":
        values = [int(number) for number in numbers]
        defaults = PowerSGDSpec()
        return powersgd(rank=values[0] if values else defaults.rank,
                        start_iter=values[1] if len(values) > 1 else defaults.start_iter)
    return {"none": NoneCompressor, "fp16": FP16Compressor, "bf16": BF16Compressor}[name]


class Compression:
    """The compressors a collective, DistributedGradientTape or DistributedOptimizer accepts, and the
    specs of PowerSGD and top-k, which only hora.torch.DistributedOptimizer accepts."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = staticmethod(powersgd)
    topk = staticmethod(topk)
