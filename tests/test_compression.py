"""hora.compression's casts outside any job: Compression.bf16 (hora's addition to Horovod's none and
fp16) on NumPy arrays and on each framework installed here, against fp16 on the values fp16 loses.
MXNet's refusal is checked with real NDArrays in tests/hora_mxnet."""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest

from hora.compression import Compression

VALUES = [1.0001, 70000.0, 1e-8, -3.14159]  # 70000 overflows float16, 1e-8 underflows it


def _frameworks() -> list[str]:
    return ["numpy"] + [name for name in ("torch", "tensorflow", "jax") if importlib.util.find_spec(name)]


def _make(framework: str, values: list[float], dtype: str):
    if framework == "numpy":
        return np.array(values, dtype=dtype)
    if framework == "torch":
        import torch

        return torch.tensor(values, dtype=getattr(torch, dtype))
    if framework == "tensorflow":
        import tensorflow as tf

        return tf.constant(values, dtype=dtype)
    import jax.numpy as jnp

    return jnp.asarray(values, dtype=dtype)


def _name(dtype) -> str:
    name = getattr(dtype, "name", None)  # NumPy, TensorFlow and JAX dtypes; torch's print as torch.X
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def _numpy(tensor) -> np.ndarray:
    if hasattr(tensor, "detach"):  # torch: bfloat16 has no NumPy form there, so widen first
        return tensor.detach().float().numpy() if str(tensor.dtype) == "torch.bfloat16" else tensor.numpy()
    return np.asarray(tensor)


# JAX makes float64 arrays only with jax_enable_x64 (else float32): float32 is its case.
@pytest.mark.parametrize(("framework", "dtype"), [(f, d) for f in _frameworks() for d in ("float32", "float64")
                                                  if (f, d) != ("jax", "float64")])
def test_bf16_sends_bfloat16_and_gives_back_the_original_dtype(framework: str, dtype: str) -> None:
    tensor = _make(framework, VALUES, dtype)
    sent, ctx = Compression.bf16.compress(tensor)
    assert _name(sent.dtype) == "bfloat16", sent.dtype
    back = Compression.bf16.decompress(sent, ctx)
    assert _name(back.dtype) == dtype, back.dtype
    expected = np.array(VALUES, dtype=dtype).astype(ml_dtypes.bfloat16).astype(dtype)
    np.testing.assert_array_equal(_numpy(back), expected)
    assert np.isfinite(_numpy(back)).all() and _numpy(back)[2] > 0
    fp16 = _numpy(Compression.fp16.decompress(*Compression.fp16.compress(tensor)))
    assert np.isinf(fp16[1]) and fp16[2] == 0  # what bf16 is for


@pytest.mark.parametrize("framework", _frameworks())
@pytest.mark.parametrize("dtype", ["int64", "float16"])
def test_bf16_leaves_integers_and_float16_as_they_are(framework: str, dtype: str) -> None:
    tensor = _make(framework, [1, 2, 3], dtype)
    sent, ctx = Compression.bf16.compress(tensor)
    assert sent is tensor and ctx is None
    assert Compression.bf16.decompress(sent, ctx) is tensor
