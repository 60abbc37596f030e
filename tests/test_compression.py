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


# ---- Compression.powersgd: a spec, refused wherever no optimizer holds its state --------------------

def test_powersgd_is_a_frozen_validated_spec_with_ddp_defaults() -> None:
    import dataclasses

    from hora.compression import PowerSGDSpec

    spec = Compression.powersgd()
    assert isinstance(spec, PowerSGDSpec)
    assert (spec.rank, spec.start_iter, spec.min_compression_rate, spec.use_error_feedback, spec.warm_start,
            spec.orthogonalization_epsilon, spec.random_seed) == (4, 1000, 2.0, True, True, 0.0, 0)
    assert Compression.powersgd(rank=2, start_iter=10) == Compression.powersgd(rank=2, start_iter=10)
    assert hash(Compression.powersgd(rank=2)) == hash(Compression.powersgd(rank=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rank = 8  # type: ignore[misc]
    assert repr(Compression.powersgd(rank=2, start_iter=10)) == "Compression.powersgd(rank=2, start_iter=10)"
    for bad in (dict(rank=0), dict(rank=1.5), dict(rank=True), dict(start_iter=-1), dict(min_compression_rate=-1),
                dict(orthogonalization_epsilon=float("nan")), dict(random_seed="0")):
        with pytest.raises(ValueError, match="Compression.powersgd"):
            Compression.powersgd(**bad)


def test_powersgd_refuses_to_compress_a_tensor_with_a_one_line_reason() -> None:
    from hora.errors import UnsupportedOperationError

    spec = Compression.powersgd(rank=4)
    for call in (lambda: spec.compress(np.ones(3, np.float32)), lambda: spec.decompress(np.ones(3), None)):
        with pytest.raises(UnsupportedOperationError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and "hora.torch.DistributedOptimizer" in message and "state" in message


def test_gradient_wrappers_refuse_powersgd_unless_they_hold_state() -> None:
    from hora import horovod_args
    from hora.binding import gradient_buckets
    from hora.errors import UnsupportedOperationError

    spec = Compression.powersgd(rank=2)
    with pytest.raises(UnsupportedOperationError, match="hora.torch.DistributedOptimizer"):
        horovod_args.check_compression(spec)
    assert horovod_args.check_compression(spec, stateful=True) is spec
    assert horovod_args.check_compression(Compression.fp16) is Compression.fp16
    with pytest.raises(TypeError, match=r"must be called: Compression.powersgd\(rank=4"):
        horovod_args.check_compression(Compression.powersgd)
    assert not gradient_buckets.bucketable(None, spec)  # never flattened into a plain bucket


# ---- HORA_COMPRESSION / hora run --compression: the text form --------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("none", Compression.none), ("fp16", Compression.fp16), ("BF16", Compression.bf16), (" fp16 ", Compression.fp16),
    ("powersgd", Compression.powersgd()), ("powersgd:4", Compression.powersgd(rank=4)),
    ("powersgd:8:100", Compression.powersgd(rank=8, start_iter=100)),
    ("PowerSGD:2:0", Compression.powersgd(rank=2, start_iter=0)),
    ("topk", Compression.topk()), ("TopK:0.05", Compression.topk(ratio=0.05)), ("topk:1", Compression.topk(ratio=1.0)),
])
def test_compression_text_parses_to_the_compressor_or_powersgd_spec(text: str, expected) -> None:
    from hora.compression import StatefulCompressionSpec, parse_compression

    result = parse_compression(text)
    assert result == expected
    if not isinstance(expected, StatefulCompressionSpec):
        assert result is expected  # the namespace's own classes, which every binding compares by identity


@pytest.mark.parametrize("text", ["", "fp32", "topk:0", "topk:1.5", "topk:nan", "topk:x", "topk:0.1:2", "topk:",
                                  "fp16:2", "powersgd:0", "powersgd:x", "powersgd:4.5",
                                  "powersgd:4:-1", "powersgd:4:1:2", "powersgd:", "powersgd::5"])
def test_bad_compression_text_lists_the_accepted_forms(text: str) -> None:
    from hora import config
    from hora.compression import parse_compression
    from hora.errors import ConfigError

    with pytest.raises(ValueError, match=r"none, fp16, bf16, powersgd\[:RANK\[:START_ITER\]\] or topk\[:RATIO\]"):
        parse_compression(text)
    with pytest.raises(ConfigError) as info:  # read from the environment: the variable is named
        config.get("compression", {"HORA_COMPRESSION": text})
    message = str(info.value)
    assert "HORA_COMPRESSION" in message and "powersgd[:RANK[:START_ITER]]" in message and "\n" not in message


def test_compression_knob_is_unset_by_default_and_has_no_horovod_alias() -> None:
    from hora import config

    assert config.get("compression", {}) is None
    assert config.knob("compression").alias is None  # Horovod has no such variable
    assert config.get("compression", {"HORA_COMPRESSION": "PowerSGD:4"}) == "powersgd:4"
