"""The per-tensor path choice (device vs host) and the device fusion buffer's layout."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hora.nccl import fusion  # noqa: E402 - after torch importorskip
from hora.nccl.device_tensor import DL_CUDA, DL_CUDA_MANAGED, device_of  # noqa: E402 - after torch importorskip
from hora.nccl.path import DEVICE, HOST, NcclRequired, choose_path, parse_mode  # noqa: E402 - after torch importorskip
from hora.transport.base import ReduceOp  # noqa: E402 - after torch importorskip

pytestmark = pytest.mark.timeout(60)

READY = lambda: (True, "ready")  # noqa: E731
NO_NCCL = lambda: (False, "no NCCL library found")  # noqa: E731


def _never():
    raise AssertionError("a CPU tensor must not load NCCL")


def test_cpu_tensors_keep_host_transports_without_touching_nccl():
    for tensor in (torch.ones(3), np.ones(3)):
        choice = choose_path(device_of(tensor), np.dtype(np.float32), ReduceOp.SUM, "require", _never)
        assert choice.path == HOST and "CPU tensor" in choice.reason


def test_cuda_tensor_goes_to_device_when_nccl_is_ready():
    for device in ((DL_CUDA, 0), (DL_CUDA_MANAGED, 1)):
        choice = choose_path(device, np.dtype(np.float32), ReduceOp.AVERAGE, "auto", READY)
        assert choice.path == DEVICE


@pytest.mark.parametrize("dtype,op,scaled,mode,ready,why", [
    (np.float32, ReduceOp.SUM, False, "auto", NO_NCCL, "NCCL unusable (no NCCL library found)"),
    (np.float32, ReduceOp.SUM, False, "off", READY, "HORA_NCCL=off"),
    (np.int16, ReduceOp.SUM, False, "auto", READY, "NCCL has no data type for int16"),
    (np.float32, ReduceOp.ADASUM, False, "auto", READY, "Adasum runs on the host path"),
    (np.bool_, ReduceOp.SUM, False, "auto", READY, "Sum of booleans"),
    (np.float32, ReduceOp.MAX, True, "auto", READY, "NCCL scales only Sums, not MAX"),
])
def test_cuda_tensor_falls_back_to_host_and_says_why(dtype, op, scaled, mode, ready, why):
    choice = choose_path((DL_CUDA, 0), np.dtype(dtype), op, mode, ready, scaled=scaled)
    assert choice.path == HOST and why in choice.reason and "host memory" in choice.reason


def test_data_movement_ignores_the_reduction_rules():
    # broadcast/allgather of booleans and bfloat16 move bytes: no reduction to overflow
    assert choose_path((DL_CUDA, 0), np.dtype(np.bool_), None, "auto", READY).path == DEVICE
    assert choose_path((DL_CUDA, 0), np.dtype(ml_dtypes.bfloat16), None, "auto", READY).path == DEVICE


def test_require_mode_refuses_with_the_reason():
    with pytest.raises(NcclRequired, match="no NCCL library found"):
        choose_path((DL_CUDA, 0), np.dtype(np.float32), ReduceOp.SUM, "require", NO_NCCL)


def test_mode_parsing():
    assert [parse_mode(t) for t in ("auto", "1", "OFF", "0", "require")] == ["auto", "auto", "off", "off", "require"]
    with pytest.raises(ValueError, match="expected one of"):
        parse_mode("sometimes")


def test_small_tensors_share_a_bucket_at_aligned_offsets():
    buckets = fusion.plan([("f32", 100), ("f32", 300), ("f32", 4)], threshold=4096)
    assert len(buckets) == 1
    slots = [(s.index, s.offset, s.nbytes) for s in buckets[0].slots]
    assert slots == [(0, 0, 100), (1, 256, 300), (2, 768, 4)]
    assert buckets[0].nbytes == 1024 and buckets[0].fused
    assert all(s.offset % fusion.ALIGNMENT == 0 for s in buckets[0].slots)


def test_keys_threshold_and_large_tensors():
    entries = [("f32", 1000), ("f16", 1000), ("f32", 1000), ("f32", 5000), ("f32", 1000), ("f32", 1000)]
    buckets = fusion.plan(entries, threshold=2048)
    layout = [(b.key, [s.index for s in b.slots]) for b in buckets]
    # f32 tensors 0 and 2 fuse (1024 + 1000 <= 2048); 3 is above the threshold and travels alone;
    # 4 opens a new f32 bucket because the first one is full, and 5 joins it (1024 + 1000 <= 2048)
    assert layout == [("f32", [0, 2]), ("f16", [1]), ("f32", [3]), ("f32", [4, 5])]
    assert not buckets[2].fused and buckets[2].slots[0].offset == 0
    assert fusion.buffer_bytes(buckets) == 2048


def test_threshold_zero_disables_fusion():
    buckets = fusion.plan([("f32", 4), ("f32", 4)], threshold=0)
    assert [len(b.slots) for b in buckets] == [1, 1] and fusion.buffer_bytes(buckets) == 0
