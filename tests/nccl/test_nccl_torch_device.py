"""hora.torch's side of the device path, on CPU: CPU tensors never reach NCCL, and a tensor's device
buffer is read from torch itself (pointer, dtype, layout) rather than through DLPack, which refuses
tensors that require grad."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hora.engine.request import Kind  # noqa: E402 - after torch importorskip
from hora.nccl import context  # noqa: E402 - after torch importorskip
from hora.nccl.device_tensor import DL_CUDA  # noqa: E402 - after torch importorskip
from hora.torch.device import buffer_of, cuda_request  # noqa: E402 - after torch importorskip


def test_cpu_tensors_take_the_host_path_without_asking_nccl(monkeypatch):
    def fail() -> tuple[bool, str]:
        raise AssertionError("a CPU tensor asked whether NCCL is usable")

    monkeypatch.setattr(context, "ready", fail)
    for tensor in (torch.ones(3), torch.ones(3, requires_grad=True), torch.ones(2, 2).t()):
        assert cuda_request(Kind.ALLREDUCE, tensor, "x", None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype,expected", [
    (torch.float16, np.float16), (torch.bfloat16, ml_dtypes.bfloat16), (torch.float32, np.float32),
    (torch.float64, np.float64), (torch.int8, np.int8), (torch.uint8, np.uint8), (torch.int32, np.int32),
    (torch.int64, np.int64), (torch.bool, np.bool_),
])
def test_buffer_is_read_from_torch_with_every_dtype(dtype, expected):
    tensor = torch.zeros(4, 3, dtype=dtype)
    buf = buffer_of(tensor, stream=7)
    assert buf.ptr == tensor.data_ptr() and buf.dtype == np.dtype(expected)
    assert buf.shape == (4, 3) and buf.contiguous and buf.stream == 7 and buf.device_type == DL_CUDA
    assert buf.keepalive is tensor


def test_buffer_of_a_parameter_and_of_a_view():
    param = torch.nn.Parameter(torch.ones(3, 2))  # DLPack would refuse: it requires grad
    assert buffer_of(param, None).ptr == param.data_ptr()
    assert not buffer_of(param.t(), None).contiguous
    assert buffer_of(torch.zeros(2, dtype=torch.int16), None) is None  # NCCL has no int16: host path
