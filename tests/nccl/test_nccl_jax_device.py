"""hora.jax's device path: single-device GPU jax.Arrays on NCCL, and through host memory when NCCL cannot.

On CPU, three layers of seams:

- two real worker processes run hora.jax's public API on arrays of a second host device that
  ``hora.jax.device.dlpack_device`` reports as CUDA device 0, with NCCL and CUDA emulated in host
  memory (nccl_emulation.py): under ``HORA_NCCL=require`` every collective must take the device path
  (a jax.Array comes back on the input's device, made by jax and filled by NCCL; hora.jax passes no
  stream, so the executor hands it back only once the GPU is done); under ``HORA_NCCL=off`` the same
  calls go through host memory and must give the same results on the same device, without one
  NCCL call. They run first, before this process starts jax (forking after that draws a warning);
- where an array lives is decided from its jax device alone (``dl_device_type``, ``dlpack_device``),
  checked on fake GPU arrays (a ``jax.Array`` subclass whose devices say ``platform='gpu'``), as is
  the DLPack read of its buffer (in place, no copy) and the making of results;
- the last test needs a real GPU that jax sees (and libnccl); elsewhere it skips saying why.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from job_env import clean_env

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402 - after the importorskip

import hora  # noqa: E402 - after the importorskip
from hora.nccl.device_tensor import DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_ROCM  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.timeout(120)

JAX_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false",
    "OMP_NUM_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


# ---- the whole path on 2 workers, NCCL and CUDA emulated --------------------------------------------

def _base(rank: int, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    """Small integers (exact in float32 after averaging over 2 ranks) that differ by rank and salt."""
    count = int(np.prod(shape)) if shape else 1
    return ((np.arange(count) * 3 + rank * 5 + salt) % 11 - 5).astype(np.float32).reshape(shape)


def _collectives(hvd: Any, put: Any, r: int) -> dict:
    """hora.jax's collectives on "GPU" arrays (``put`` places one there); every result with its devices."""
    results: dict[str, Any] = {}

    def keep(key: str, value: Any) -> None:
        results[key] = value

    x = put(_base(r, (4, 3)))
    keep("avg", hvd.allreduce(x, name="avg"))
    keep("input_kept", np.array_equal(np.asarray(x), _base(r, (4, 3))))
    keep("sum", hvd.allreduce(x, op=hvd.Sum, name="sum"))
    keep("scaled", hvd.allreduce(put(_base(r, (4,), 2)), op=hvd.Sum, prescale_factor=2.0, postscale_factor=1.5,
                                 name="scaled"))
    keep("min", hvd.allreduce(put(_base(r, (6,), 3)), op=hvd.Min, name="min"))
    tree = hvd.allreduce({"a": put(_base(r, (3,), 4)), "b": put(_base(r, (2, 2), 5))}, op=hvd.Sum, name="tree")
    keep("tree.a", tree["a"])
    keep("tree.b", tree["b"])
    handle = hvd.allreduce_async(put(_base(r, (5,), 6)), op=hvd.Sum, name="async")
    keep("async", hvd.synchronize(handle))
    keep("allgather", hvd.allgather(put(_base(r, (2 + r, 3), 7)), name="ag"))
    keep("allgather_scalar", hvd.allgather(put(np.float32(r + 1)), name="ag0"))
    keep("broadcast", hvd.broadcast(put(_base(r, (3, 2), 8)), root_rank=1, name="bc"))
    splits = [1, 2] if r == 0 else [3, 1]
    received, recv_splits = hvd.alltoall(put(_base(r, (3 if r == 0 else 4, 2), 9)), splits=splits, name="a2a")
    keep("alltoall", received)
    keep("alltoall_splits", np.asarray(recv_splits))
    keep("reducescatter", hvd.reducescatter(put(_base(r, (5, 2), 10)), op=hvd.Average, name="rs"))
    keep("grouped_reducescatter", hvd.grouped_reducescatter([put(_base(r, (4, 2), 11))], op=hvd.Sum, name="grs")[0])
    return results


def _described(results: dict) -> dict:
    """Values as NumPy, plus the type and devices of every jax.Array result."""
    out = {}
    for key, value in results.items():
        if isinstance(value, jax.Array):
            out[key] = (np.asarray(value), type(value).__name__, sorted(str(d) for d in value.devices()))
        else:
            out[key] = value
    return out


def _job() -> dict:
    import sys
    import threading

    sys.path.insert(0, os.path.dirname(__file__))
    import nccl_emulation

    import hora.jax as hvd
    from hora.jax import device, mpi_ops
    from hora.nccl.path import NcclRequired

    _, nccl = nccl_emulation.install()
    submitted: list[tuple] = []  # (path, stream) of every device request hora.jax hands to the engine
    submit = mpi_ops.collectives.submit_requests
    mpi_ops.collectives.submit_requests = lambda requests: submitted.extend(
        (r.signature.device, r.buffer.stream) for r in requests) or submit(requests)
    gpu = jax.devices()[1]  # the emulated GPU; jax.devices()[0] stays a CPU device
    real = device.dlpack_device
    device.dlpack_device = lambda a: (DL_CUDA, 0) if a.sharding.device_set == {gpu} else real(a)
    made_in: list[str] = []
    make = device.Allocator._make
    device.Allocator._make = lambda self, shape: made_in.append(threading.current_thread().name) or make(self, shape)

    def put(value: np.ndarray) -> jax.Array:
        return jax.device_put(value, gpu)

    hvd.init()
    r = hvd.rank()
    out: dict[str, Any] = {"calls_before": list(nccl.calls)}
    os.environ["HORA_NCCL"] = "require"  # worker-local: every collective below must take NCCL
    out["require"] = _described(_collectives(hvd, put, r))
    out["require.calls"] = sorted(set(nccl.calls))
    out["require.submitted"] = sorted(set(submitted))
    out["require.requests"] = len(submitted)
    out["allreduce_made_in"] = made_in[:1]
    try:
        hvd.allreduce(put(np.arange(4, dtype=np.int16)), op=hvd.Sum, name="int16")
        out["int16_error"] = None
    except NcclRequired as exc:
        out["int16_error"] = str(exc)
    calls_before_cpu = len(nccl.calls)
    out["cpu"] = _described({"sum": hvd.allreduce(jnp.asarray(_base(r, (3,))), op=hvd.Sum, name="cpu")})
    out["cpu.calls"] = nccl.calls[calls_before_cpu:]
    try:
        sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",)),
                                              jax.sharding.PartitionSpec("d"))
        hvd.allreduce(jax.device_put(jnp.arange(4.0), sharding))
        out["sharded_error"] = None
    except ValueError as exc:
        out["sharded_error"] = str(exc)
    os.environ["HORA_NCCL"] = "off"  # the same calls through host memory: no NCCL call at all
    calls_before_off = len(nccl.calls)
    out["off"] = _described(_collectives(hvd, put, r))
    out["off.int16"] = _described({"sum": hvd.allreduce(put(np.arange(4, dtype=np.int16)), op=hvd.Sum,
                                                        name="int16.off")})
    out["off.calls"] = nccl.calls[calls_before_off:]
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return hora.run(_job, np=2, env=clean_env(JAX_ENV), start_timeout=60)


def _expected(rank: int) -> dict[str, np.ndarray]:
    both = range(2)

    def total(shape, salt, scale=1.0):
        return sum(_base(s, shape, salt) * np.float32(scale) for s in both)

    reduced = total((5, 2), 10) / 2
    chunks = [np.split(_base(0, (3, 2), 9), [1]), np.split(_base(1, (4, 2), 9), [3])]
    grs = total((4, 2), 11)
    return {
        "avg": total((4, 3), 0) / 2, "sum": total((4, 3), 0), "scaled": total((4,), 2, 3.0),
        "min": np.minimum(_base(0, (6,), 3), _base(1, (6,), 3)), "tree.a": total((3,), 4),
        "tree.b": total((2, 2), 5), "async": total((5,), 6),
        "allgather": np.concatenate([_base(s, (2 + s, 3), 7) for s in both]),
        "allgather_scalar": np.array([1.0, 2.0], np.float32), "broadcast": _base(1, (3, 2), 8),
        "alltoall": np.concatenate([chunks[0][rank], chunks[1][rank]]),
        "reducescatter": reduced[:3] if rank == 0 else reduced[3:],
        "grouped_reducescatter": grs[:2] if rank == 0 else grs[2:],
    }


def _check_collectives(got: dict, rank: int) -> None:
    for key, want in _expected(rank).items():
        value, kind, devices = got[key]
        assert kind == "ArrayImpl" and devices == ["cpu:1"], (key, kind, devices)  # a jax.Array, same device
        np.testing.assert_array_equal(value, want, err_msg=key)
        assert value.dtype == want.dtype, key
    assert got["input_kept"]
    np.testing.assert_array_equal(got["alltoall_splits"], [1, 3] if rank == 0 else [2, 1])


def test_gpu_arrays_take_nccl_and_come_back_as_jax_arrays_on_their_device(results):
    for rank, out in enumerate(results):
        assert out["calls_before"] == []
        _check_collectives(out["require"], rank)
        assert {"all_reduce", "all_gather", "broadcast", "send", "recv", "reduce_scatter"} <= set(
            out["require.calls"]), out["require.calls"]


def test_no_stream_is_passed_and_same_shape_results_are_made_in_the_callers_thread(results):
    for out in results:
        # jax has no stream to chain on: the executor completes such items only once the GPU is done
        assert out["require.submitted"] == [("cuda", None)] and out["require.requests"] == 13  # one per array above
        assert out["allreduce_made_in"] == ["MainThread"]


def test_require_names_why_nccl_cannot_carry_an_array_and_cpu_arrays_stay_on_the_host(results):
    for rank, out in enumerate(results):
        assert "HORA_NCCL=require" in out["int16_error"] and "int16" in out["int16_error"]
        np.testing.assert_array_equal(out["cpu"]["sum"][0], _base(0, (3,)) + _base(1, (3,)))
        assert out["cpu.calls"] == []
        assert f"rank {rank} on " in out["sharded_error"] and "sharded over 2 devices" in out["sharded_error"]


def test_with_nccl_off_gpu_arrays_go_through_host_memory_back_to_their_device(results):
    for rank, out in enumerate(results):
        _check_collectives(out["off"], rank)
        value, _, devices = out["off.int16"]["sum"]
        np.testing.assert_array_equal(value, 2 * np.arange(4, dtype=np.int16))
        assert value.dtype == np.int16 and devices == ["cpu:1"]
        assert out["off.calls"] == []


# ---- fake GPU arrays: a jax.Array whose devices say 'gpu' ------------------------------------------

def _cpu(value: Any) -> jax.Array:
    """``value`` on jax's CPU device (where jax sees a GPU, that is its default device)."""
    return jax.device_put(value, jax.devices("cpu")[0])


class _FakeDevice:
    def __init__(self, index: int) -> None:
        self.platform = "gpu"
        self.client = SimpleNamespace(platform_version="cuda 13000")
        self.id = self.local_hardware_id = index


class _FakeSharding:
    def __init__(self, devices: list[Any], replicated: bool) -> None:
        self.device_set = set(devices)
        self.memory_kind = "device"
        self.is_fully_replicated = replicated


class FakeGpuArray(jax.Array):
    """A CPU jax.Array presented as living on ``count`` CUDA devices (sharded when more than one)."""

    def __init__(self, inner: jax.Array, count: int = 1) -> None:
        self.inner = inner
        self._sharding = _FakeSharding([_FakeDevice(i) for i in range(count)], replicated=count == 1)

    @property
    def sharding(self) -> _FakeSharding:  # type: ignore[override]
        return self._sharding

    @property
    def is_fully_replicated(self) -> bool:  # type: ignore[override]
        return self._sharding.is_fully_replicated

    @property
    def dtype(self):  # type: ignore[override]
        return self.inner.dtype

    @property
    def shape(self):  # type: ignore[override]
        return self.inner.shape

    def __dlpack__(self, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.inner.__dlpack__(**kwargs)


def test_a_single_device_gpu_array_is_accepted():
    from hora.jax.arrays import check_device

    check_device(FakeGpuArray(_cpu(np.arange(4.0))))  # refused before: "collectives run on host (CPU) buffers"


def test_only_arrays_outside_host_memory_count_as_on_an_accelerator():
    from hora.jax.arrays import on_accelerator

    assert on_accelerator(FakeGpuArray(_cpu(np.arange(4.0))))
    assert not any(on_accelerator(x) for x in (_cpu(np.arange(4.0)), np.arange(4.0), 2.0))


def test_an_array_sharded_over_gpus_is_refused_naming_why():
    from hora.jax.arrays import check_device

    with pytest.raises(ValueError) as info:
        check_device(FakeGpuArray(_cpu(np.arange(4.0)), count=2))
    message = str(info.value)
    assert "rank ? on " in message and "sharded over 2 devices" in message and "one buffer per rank" in message


@pytest.mark.parametrize(("platform", "version", "memory_kind", "expected"), [
    ("gpu", "cuda 13000", None, DL_CUDA), ("gpu", "cuda 12080", "device", DL_CUDA), ("cuda", "", None, DL_CUDA),
    ("gpu", "cuda 13000", "pinned_host", DL_CUDA_HOST), ("gpu", "cuda 13000", "unpinned_host", DL_CUDA_HOST),
    ("gpu", "rocm 6.2", None, DL_ROCM), ("rocm", "", None, DL_ROCM), ("cpu", "cpu", "device", DL_CPU),
    ("tpu", "PJRT C API", "device", 0),
])
def test_the_path_is_decided_from_the_jax_device(platform, version, memory_kind, expected):
    from hora.jax.device import dl_device_type

    assert dl_device_type(platform, version, memory_kind) == expected


def test_a_gpu_array_is_read_through_dlpack_in_place():
    from hora.jax import device

    inner = _cpu(np.arange(6, dtype=np.float32).reshape(2, 3))
    gpu = FakeGpuArray(inner)
    assert device.dlpack_device(gpu) == (DL_CUDA, 0) and device.is_cuda(gpu)
    buf = device.device_buffer(gpu)
    assert buf.ptr == inner.unsafe_buffer_pointer()  # no copy: the array's own memory
    assert (buf.device_type, buf.device_id, buf.dtype, buf.shape, buf.contiguous) == (
        DL_CUDA, 0, np.dtype(np.float32), (2, 3), True)
    assert any(k is gpu for k in buf.keepalive)  # the memory outlives the collective


def test_cpu_arrays_never_ask_whether_nccl_is_usable(monkeypatch):
    from hora.engine.request import Kind
    from hora.jax import device
    from hora.nccl import context

    def fail() -> tuple[bool, str]:
        raise AssertionError("a CPU array asked whether NCCL is usable")

    monkeypatch.setattr(context, "ready", fail)
    for x in (_cpu(np.ones(3)), np.ones(3), 1.0, FakeGpuArray(_cpu(np.ones(3)), count=2)):
        assert not device.is_cuda(x)
        assert device.cuda_request(Kind.ALLREDUCE, x, "x", None) is None  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")
def test_results_are_made_by_jax_on_the_input_device_and_checked():
    from hora.jax.device import Allocator

    like = _cpu(np.ones((2, 3), np.float32))
    allocate = Allocator(like)
    allocate.prepare()
    ready, _ = allocate._ready or (None, None)
    out, buf = allocate((2, 3))
    assert out is ready and buf.ptr == out.unsafe_buffer_pointer()  # the prepared result, once
    other, _ = allocate((4, 3))
    assert other.shape == (4, 3) and other.dtype == jnp.float32 and other.devices() == like.devices()
    wide = Allocator(like)
    wide.dtype = np.dtype(np.float64)
    with jax.enable_x64(False), pytest.raises(TypeError, match="thread-local"):
        wide((2,))  # jax would make float32: NCCL must never write 8-byte elements into it


# ---- a real GPU ------------------------------------------------------------------------------------

def _gpu_skip_reason() -> str | None:
    """Why the GPU test cannot run here, from what is installed (jax's GPU backend is not started
    in this process: it would take most of the GPU's memory before the worker does)."""
    from importlib import metadata

    from hora.nccl import library

    plugins = [d.metadata["Name"] for d in metadata.distributions()
               if (d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda"))]
    if not plugins:
        return "no GPU test: jax has no CUDA plugin here (pip install \"jax[cuda13]\")"
    if not library.nccl_version():
        return "no GPU test: libnccl is not installed (pip install \"hora[cuda]\")"
    return None


def _gpu_job() -> dict:
    import jax

    import hora.jax as hvd

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return {"skip": f"no GPU test: jax sees no GPU ({jax.devices()})"}
    hvd.init()
    out: dict[str, Any] = {}
    for mode in ("require", "off"):  # NCCL on the device, then through host memory
        os.environ["HORA_NCCL"] = mode
        x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + 1  # uncommitted, on the default GPU
        results = {
            "sum": hvd.allreduce(x, op=hvd.Sum, name=f"{mode}.sum"),
            "average": hvd.allreduce(x, name=f"{mode}.avg"),
            "scaled": hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.5, name=f"{mode}.scaled"),
            "allgather": hvd.allgather(x, name=f"{mode}.ag"),
            "broadcast": hvd.broadcast(x, root_rank=0, name=f"{mode}.bc"),
            "grouped": hvd.grouped_allreduce([x, x[0]], op=hvd.Sum, name=f"{mode}.grp")[1],
            "bf16": hvd.allreduce(x.astype(jnp.bfloat16), op=hvd.Sum, name=f"{mode}.bf16"),
            "jit": jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum))(x),  # a host callback, as before
        }
        out[mode] = {key: (np.asarray(value.astype(jnp.float32)), isinstance(value, jax.Array),
                           sorted(str(d) for d in value.devices()), str(value.dtype))
                     for key, value in results.items()}
        out[mode + ".input"] = sorted(str(d) for d in x.devices())
    out["x"] = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    hvd.shutdown()
    return out


def test_one_rank_on_a_real_gpu_returns_jax_arrays_on_that_gpu():
    """One worker (NCCL refuses two ranks on one GPU), first under ``HORA_NCCL=require`` (every call
    on NCCL, or an error), then ``off`` (through host memory): allreduce Sum, Average, scaled, a
    group, bfloat16, allgather and broadcast each return a jax.Array on the input's GPU with the
    right values; a jitted allreduce (a host callback) too. The worker starts jax without
    preallocating (this process may hold jax's GPU memory pool already)."""
    reason = _gpu_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    env = clean_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_CPP_MIN_LOG_LEVEL": "2"})
    [out] = hora.run(_gpu_job, np=1, env=env, start_timeout=60)
    if "skip" in out:
        pytest.skip(out["skip"])
    x = out["x"]
    want = {"sum": x, "average": x, "scaled": x * 0.5, "allgather": x, "broadcast": x, "grouped": x[0], "bf16": x,
            "jit": x}
    dtypes = {"bf16": "bfloat16"}
    for mode in ("require", "off"):
        for key, expected in want.items():
            value, is_jax, devices, dtype = out[mode][key]
            assert is_jax and devices == out[mode + ".input"], (mode, key, devices)
            assert dtype == dtypes.get(key, "float32"), (mode, key, dtype)
            np.testing.assert_array_equal(value, expected, err_msg=f"{mode} {key}")
