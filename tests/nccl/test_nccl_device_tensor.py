"""DLPack and ``__cuda_array_interface__`` reading on real tensors (CPU tensors: the same structures as CUDA ones)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hora.nccl import device_tensor as dt  # noqa: E402 - after torch importorskip

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dtype,np_dtype", [
    (torch.float32, np.float32), (torch.float16, np.float16), (torch.bfloat16, ml_dtypes.bfloat16),
    (torch.int64, np.int64), (torch.uint8, np.uint8), (torch.bool, np.bool_), (torch.float64, np.float64)])
def test_torch_capsule_gives_pointer_dtype_shape(dtype, np_dtype):
    t = torch.zeros((3, 5), dtype=dtype)
    buf = dt.from_dlpack(t)
    assert buf.ptr == t.data_ptr()
    assert buf.dtype == np.dtype(np_dtype)
    assert buf.shape == (3, 5) and buf.count == 15 and buf.nbytes == t.nbytes
    assert (buf.device_type, buf.device_id) == (dt.DL_CPU, 0) and not buf.on_cuda
    assert buf.contiguous


def test_views_keep_offset_and_strides():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    rows = dt.from_dlpack(base[1:3])
    assert rows.ptr == base[1:3].data_ptr() and rows.contiguous and rows.shape == (2, 6)
    transposed = dt.from_dlpack(base.t())
    assert not transposed.contiguous and transposed.shape == (6, 4)
    column = dt.from_dlpack(base[:, :1])
    assert column.contiguous is False  # rows are 6 elements apart, so the 4x1 column is strided
    single = dt.from_dlpack(base[:1, :])  # an extent-1 dimension may carry any stride
    assert single.contiguous


def test_capsule_is_not_consumed_and_memory_stays_valid():
    t = torch.arange(4, dtype=torch.int32)
    buf = dt.from_dlpack(t)
    capsule, owner = buf.keepalive
    assert owner is t
    # the capsule still carries its original name: its producer frees the tensor as usual
    assert dt._capsule_name(capsule) in (b"dltensor", b"dltensor_versioned")
    assert np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int32 * 4).from_address(buf.ptr)).tolist() == [0, 1, 2, 3]


def test_numpy_and_jax_through_dlpack():
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    buf = dt.describe(a)
    assert buf.ptr == a.ctypes.data and buf.dtype == np.int16 and buf.shape == (2, 3)
    assert dt.device_of(a) == (dt.DL_CPU, 0)
    jax = pytest.importorskip("jax")
    # on the CPU device explicitly: where JAX sees a GPU, that is its default device
    j = jax.device_put(jax.numpy.ones((4,), dtype=jax.numpy.float32), jax.devices("cpu")[0])
    assert dt.describe(j).shape == (4,) and dt.device_of(j) == (dt.DL_CPU, 0)


@pytest.mark.timeout(300)  # importing TensorFlow is slow on a loaded 2-core machine
def test_tensorflow_through_dlpack():
    tf = pytest.importorskip("tensorflow")
    x = tf.constant([[1.0, 2.0]], dtype=tf.float32)
    buf = dt.from_dlpack_capsule(tf.experimental.dlpack.to_dlpack(x))
    assert buf.shape == (1, 2) and buf.dtype == np.float32 and buf.device_type == dt.DL_CPU


class _Cai:
    """An object that speaks only ``__cuda_array_interface__`` (as Numba's and CuPy's arrays do)."""

    def __init__(self, **desc):
        self.__cuda_array_interface__ = desc


def test_cuda_array_interface_v3():
    obj = _Cai(shape=(4, 2), typestr="<f4", data=(0x7F0000001000, False), strides=None, version=3, stream=7)
    buf = dt.describe(obj)
    assert buf.ptr == 0x7F0000001000 and buf.dtype == np.float32 and buf.shape == (4, 2)
    assert buf.on_cuda and buf.device_id == -1 and buf.stream == 7 and buf.contiguous
    assert dt.device_of(obj) == (dt.DL_CUDA, -1)
    strided = dt.from_cuda_array_interface(_Cai(shape=(4, 2), typestr="<i8", data=(16, False), strides=(8, 32),
                                                version=3))
    assert not strided.contiguous and strided.stream is None
    with pytest.raises(TypeError, match="masked"):
        dt.from_cuda_array_interface(_Cai(shape=(1,), typestr="<f4", data=(16, False), mask=object(), version=2))


def test_rejects_consumed_capsule_and_unknown_objects():
    t = torch.zeros(2)
    capsule = t.__dlpack__()
    torch.from_dlpack(capsule)  # consumes it (renamed to used_dltensor)
    with pytest.raises(ValueError, match="unconsumed"):
        dt.from_dlpack_capsule(capsule)
    with pytest.raises(TypeError, match="neither DLPack"):
        dt.describe([1, 2, 3])


def test_torch_device_attribute_fallback():
    class FakeCudaDevice:
        type, index = "cuda", 1

    class Holder:
        device = FakeCudaDevice()

    assert dt.device_of(Holder()) == (dt.DL_CUDA, 1)
