"""hora.tensorflow's device path: GPU tensors on NCCL through DLPack, eagerly and inside tf.function.

On CPU: ONE job of two real workers (TensorFlow costs ~9 CPU-seconds to import per process, so every
check runs as a section of that job; this process never imports TensorFlow). NCCL and CUDA are
emulated in host memory (nccl_emulation.py) and the one seam that says where a tensor's memory lives,
``hora.tensorflow.device.dlpack_device`` (a TensorFlow device name -> DLPack device), reports every
device as CUDA device 0, so CPU tensors take the whole device path:

- under ``HORA_NCCL=require`` every collective must go to NCCL (with no stream: TensorFlow has none
  hora can chain on) and come back as a TensorFlow tensor of the right dtype and shape, eagerly and
  inside a tf.function (staged as ``tf.py_function``, whose Python body gets EagerTensors);
- under ``HORA_NCCL=off`` the same calls give the same values without one NCCL call (a function
  traced then is staged as ``tf.numpy_function``, as before);
- the seam's own reading of device names, and the in-place DLPack read of a tensor, are checked in
  the same job.

The last test needs a GPU TensorFlow sees (and libnccl); elsewhere it skips saying why.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import pytest
from job_env import clean_env

import hora

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
          "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
GPU_NAME = "/job:localhost/replica:0/task:0/device:GPU:0"


def _base(rank: int, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    """Small integers (exact in float32 after averaging over 2 ranks) that differ by rank and salt."""
    count = int(np.prod(shape)) if shape else 1
    return ((np.arange(count) * 3 + rank * 5 + salt) % 11 - 5).astype(np.float32).reshape(shape)


def _collectives(hvd: Any, tf: Any, r: int, tag: str) -> dict[str, Any]:
    """hora.tensorflow's collectives on tensors the seam places on the "GPU"; eager or traced alike."""
    def put(value: np.ndarray, dtype: Any = None) -> Any:
        return tf.constant(value, dtype=dtype)

    x = put(_base(r, (4, 3)))
    grouped = hvd.grouped_allreduce([put(_base(r, (3,), 4)), put(_base(r, (2, 2), 5))], op=hvd.Sum,
                                    name=f"{tag}.grp")
    received, recv_splits = hvd.alltoall(put(_base(r, (3 if r == 0 else 4, 2), 9)),
                                         splits=[1, 2] if r == 0 else [3, 1], name=f"{tag}.a2a")
    return {
        "avg": hvd.allreduce(x, name=f"{tag}.avg"),
        "sum": hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.sum"),
        "scaled": hvd.allreduce(put(_base(r, (4,), 2)), op=hvd.Sum, prescale_factor=2.0, postscale_factor=1.5,
                                name=f"{tag}.scaled"),
        "min": hvd.allreduce(put(_base(r, (6,), 3)), op=hvd.Min, name=f"{tag}.min"),
        "half": hvd.allreduce(put(_base(r, (3,), 1), tf.float16), op=hvd.Sum, name=f"{tag}.half"),
        "grp.0": grouped[0], "grp.1": grouped[1],
        "allgather": hvd.allgather(put(_base(r, (2 + r, 3), 7)), name=f"{tag}.ag"),
        "allgather_scalar": hvd.allgather(put(np.float32(r + 1)), name=f"{tag}.ag0"),
        "allgather_bool": hvd.allgather(put(np.array([r == 0, True])), name=f"{tag}.agb"),
        "broadcast": hvd.broadcast(put(_base(r, (3, 2), 8)), root_rank=1, name=f"{tag}.bc"),
        "alltoall": received, "alltoall_splits": recv_splits,
        "reducescatter": hvd.reducescatter(put(_base(r, (5, 2), 10)), op=hvd.Average, name=f"{tag}.rs"),
    }


def _unsynced(events: list[str]) -> list[int]:
    """Where a request went to NCCL, or the run ended, with a result made since TensorFlow's stream
    was last synced (its zero-fill, or the memory's earlier user, could then race NCCL's writes)."""
    pending, wrong = 0, []
    for at, event in enumerate(events + ["submit"]):
        if event == "make":
            pending += 1
        elif event == "sync":
            pending = 0
        elif pending:
            wrong.append(at)
    return wrong


def _described(results: dict[str, Any]) -> dict[str, Any]:
    """Each result as (value, type name, dtype name, backing device)."""
    return {key: (t.numpy(), type(t).__name__, t.dtype.name, t.backing_device) for key, t in results.items()}


def _job() -> dict:
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    import nccl_emulation
    import sections
    from job_env import TENSORFLOW_OPTIONAL_IMPORTS, skip_imports

    skip_imports(TENSORFLOW_OPTIONAL_IMPORTS)  # before TensorFlow: a third of its import, never used here
    import tensorflow as tf

    import hora.tensorflow as hvd
    from hora import collectives
    from hora.nccl.device_tensor import DL_CUDA
    from hora.nccl.path import NcclRequired

    _, nccl = nccl_emulation.install()
    try:  # the seam; absent before hora.tensorflow had a device path
        from hora.tensorflow import device
    except ImportError:
        device = None
    real_dlpack_device = getattr(device, "dlpack_device", None)
    if device is not None:
        device.dlpack_device = lambda name: (DL_CUDA, 0)
    submitted: list[tuple] = []  # (path, stream) of every request handed to the engine as a device request
    events: list[str] = []  # results made, TensorFlow's stream synced, requests submitted: in order
    submit = collectives.submit_requests
    collectives.submit_requests = lambda requests: events.append("submit") or submitted.extend(
        (q.signature.device, q.buffer.stream) for q in requests) or submit(requests)
    if device is not None:
        make, sync = device.Allocator._make, device.sync
        device.Allocator._make = lambda self, shape: events.append("make") or make(self, shape)
        device.sync = lambda name: events.append("sync") or sync(name)
    hvd.init()
    r = hvd.rank()

    def mode(value: str) -> None:
        os.environ["HORA_NCCL"] = value  # worker-local: read by hora.config at each collective

    def calls_during(body: Any) -> dict:
        before, requests = len(nccl.calls), len(submitted)
        value = body()
        return {"value": value, "calls": sorted(set(nccl.calls[before:])), "requests": submitted[requests:]}

    traced = tf.function(lambda: _collectives(hvd, tf, r, "fn"))

    def op_types(function: Any) -> list[str]:
        return sorted({op.type for op in function.get_concrete_function().graph.get_operations()
                       if "PyFunc" in op.type})

    def eager_require() -> dict:
        mode("require")
        x = tf.constant(_base(r, (4, 3)))
        out = calls_during(lambda: _described(_collectives(hvd, tf, r, "eager")))
        out["input_kept"] = np.array_equal(x.numpy(), _base(r, (4, 3)))
        out["unsynced"] = _unsynced(events)
        return out

    def function_require() -> dict:
        mode("require")
        out = calls_during(lambda: _described(traced()))
        out["ops"] = op_types(traced)
        return out

    def gradient_require() -> dict:
        mode("require")
        x = tf.Variable(_base(r, (3,)))

        @tf.function
        def step() -> Any:
            with tf.GradientTape() as tape:
                y = hvd.allreduce(x * 2.0, op=hvd.Sum, name="grad.fwd")
            return tape.gradient(y, x)

        def tape() -> list[np.ndarray]:  # a gradient list: flattened into a bucket, as on the host path
            w = [tf.Variable(_base(r, (3,), 1)), tf.Variable(_base(r, (2, 2), 2))]
            with tf.GradientTape() as recorded:
                loss = tf.reduce_sum(w[0] * w[0]) + tf.reduce_sum(w[1]) * (r + 1)
            return [g.numpy() for g in hvd.DistributedGradientTape(recorded).gradient(loss, w)]

        return {"function": calls_during(lambda: step().numpy()), "tape": calls_during(tape)}

    def int16_require() -> str:
        mode("require")
        try:
            hvd.allreduce(tf.constant([1, 2], tf.int16), op=hvd.Sum, name="int16")
        except NcclRequired as exc:
            return str(exc)
        return "no error"

    def off() -> dict:
        mode("off")
        fresh = tf.function(lambda: _collectives(hvd, tf, r, "fresh"))
        out = calls_during(lambda: {"eager": _described(_collectives(hvd, tf, r, "off")),
                                    "function": _described(traced()), "fresh": _described(fresh())})
        out["ops"] = op_types(fresh)
        return out

    def seam() -> dict:
        from hora.nccl.device_tensor import from_dlpack_capsule

        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        buffer = device.device_buffer(x)
        flags = device.device_buffer(tf.constant([True, False]))
        names = [GPU_NAME, "/job:localhost/replica:0/task:0/device:GPU:1", "/device:CPU:0", "", "/device:TPU:0"]
        return {"devices": [real_dlpack_device(n) for n in names],
                "in_place": buffer.ptr == from_dlpack_capsule(tf.experimental.dlpack.to_dlpack(x)).ptr,
                "buffer": (buffer.device_type, buffer.device_id, str(buffer.dtype), buffer.shape),
                "bool": str(flags.dtype), "int32_is_host": not device.is_cuda(tf.constant([1, 2]))}

    out = sections.run_sections([("eager.require", eager_require), ("function.require", function_require),
                                 ("gradient.require", gradient_require), ("int16.require", int16_require),
                                 ("off", off), ("seam", seam)])
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def job() -> Any:
    from sections import JobResults

    return JobResults(hora.run(_job, np=2, env=clean_env(TF_ENV), start_timeout=90))


def _expected(rank: int) -> dict[str, np.ndarray]:
    both = range(2)

    def total(shape: tuple[int, ...], salt: int, scale: float = 1.0) -> np.ndarray:
        return sum(_base(s, shape, salt) * np.float32(scale) for s in both)

    reduced = total((5, 2), 10) / 2
    chunks = [np.split(_base(0, (3, 2), 9), [1]), np.split(_base(1, (4, 2), 9), [3])]
    return {
        "avg": total((4, 3), 0) / 2, "sum": total((4, 3), 0), "scaled": total((4,), 2, 3.0),
        "min": np.minimum(_base(0, (6,), 3), _base(1, (6,), 3)), "half": total((3,), 1).astype(np.float16),
        "grp.0": total((3,), 4), "grp.1": total((2, 2), 5),
        "allgather": np.concatenate([_base(s, (2 + s, 3), 7) for s in both]),
        "allgather_scalar": np.array([1.0, 2.0], np.float32), "allgather_bool": np.array([True, True, False, True]),
        "broadcast": _base(1, (3, 2), 8), "alltoall": np.concatenate([chunks[0][rank], chunks[1][rank]]),
        "alltoall_splits": np.array([1, 3] if rank == 0 else [2, 1], np.int32),
        "reducescatter": reduced[:3] if rank == 0 else reduced[3:],
    }


def _check(got: dict[str, Any], rank: int, kind: str) -> None:
    for key, want in _expected(rank).items():
        value, type_name, dtype, backing = got[key]
        assert type_name == kind and backing.endswith("CPU:0"), (key, type_name, backing)  # a TF tensor, in place
        np.testing.assert_array_equal(value, want, err_msg=key)
        assert value.dtype == want.dtype and dtype == np.dtype(want.dtype).name, key


_EAGER_REQUESTS = 13  # one per tensor of _collectives; alltoall's splits are no tensor of its own
#: reducescatter of 5 rows over 2 ranks is uneven: one ncclReduce per block
_NCCL_CALLS = {"all_reduce", "all_gather", "broadcast", "send", "recv", "reduce"}


def test_eager_gpu_tensors_take_nccl_without_a_stream_and_come_back_as_tf_tensors(job):
    for rank in range(2):
        out = job.get("eager.require", rank)
        _check(out["value"], rank, "EagerTensor")
        assert out["input_kept"] and out["unsynced"] == []
        assert _NCCL_CALLS <= set(out["calls"]), out["calls"]
        assert out["requests"] == [("cuda", None)] * _EAGER_REQUESTS


def test_inside_tf_function_the_collectives_are_py_functions_on_the_device_path(job):
    for rank in range(2):
        out = job.get("function.require", rank)
        _check(out["value"], rank, "EagerTensor")
        assert out["ops"] == ["EagerPyFunc"]  # tf.py_function: its Python body gets EagerTensors on the op's device
        assert _NCCL_CALLS <= set(out["calls"]) and out["requests"] == [("cuda", None)] * _EAGER_REQUESTS


def test_gradients_take_the_device_path_in_tf_function_and_through_the_tape(job):
    for rank in range(2):
        out = job.get("gradient.require", rank)
        function, tape = out["function"], out["tape"]
        np.testing.assert_array_equal(function["value"], np.full(3, 4.0, np.float32))  # d(sum of 2x)/dx, summed
        assert function["calls"] == ["all_reduce"] and len(function["requests"]) == 2
        np.testing.assert_array_equal(tape["value"][0], _base(0, (3,), 1) + _base(1, (3,), 1))  # mean of 2w
        np.testing.assert_array_equal(tape["value"][1], np.full((2, 2), 1.5, np.float32))  # mean of 1 and 2
        assert tape["calls"] == ["all_reduce"] and tape["requests"] and set(tape["requests"]) == {("cuda", None)}


def test_require_names_why_nccl_cannot_carry_a_tensor(job):
    for rank in range(2):
        message = job.get("int16.require", rank)
        assert "HORA_NCCL=require" in message and "int16" in message


def test_with_nccl_off_the_same_values_come_through_host_memory_without_nccl(job):
    for rank in range(2):
        out = job.get("off", rank)
        for part in ("eager", "function", "fresh"):
            _check(out["value"][part], rank, "EagerTensor")
        assert out["calls"] == [] and out["requests"] == []
        assert out["ops"] == ["PyFunc"]  # traced with NCCL off: tf.numpy_function, as before


def test_the_seam_reads_tf_device_names_and_dlpack_in_place(job):
    from hora.nccl.device_tensor import DL_CPU, DL_CUDA

    for rank in range(2):
        out = job.get("seam", rank)
        assert out["devices"] == [(DL_CUDA, 0), (DL_CUDA, 1), (DL_CPU, 0), (DL_CPU, 0), (0, 0)]
        # the CUDA device is read from the pointer: TensorFlow's GPU:0 is CUDA device local_rank after
        # tf.config.set_visible_devices(gpus[local_rank], 'GPU')
        assert out["in_place"] and out["buffer"] == (DL_CUDA, -1, "float32", (2, 2))
        assert out["bool"] == "bool" and out["int32_is_host"]  # TF exports bool as uint8; int32 lives on the host


# ---- a real GPU ------------------------------------------------------------------------------------

def _gpu_skip_reason() -> str | None:
    """Why the GPU test cannot run here, from what is installed (TensorFlow is not imported here)."""
    from hora.nccl import cudart, library

    if not library.nccl_version():
        return "no GPU test: libnccl is not installed (pip install \"hora[cuda]\")"
    usable, why = cudart.cuda_status()
    return None if usable else f"no GPU test: {why}"


def _gpu_job() -> dict:
    import tensorflow as tf

    import hora.tensorflow as hvd

    if not tf.config.list_physical_devices("GPU"):
        return {"skip": "no GPU test: TensorFlow sees no GPU (a CPU-only TensorFlow build, or no driver)"}
    hvd.init()
    out: dict[str, Any] = {}
    for mode in ("require", "off"):
        os.environ["HORA_NCCL"] = mode
        with tf.device("/GPU:0"):
            x = tf.reshape(tf.range(12, dtype=tf.float32), (3, 4)) + 1
        traced = tf.function(lambda v: hvd.allreduce(v, op=hvd.Sum))
        results = {"sum": hvd.allreduce(x, op=hvd.Sum, name=f"{mode}.sum"), "average": hvd.allreduce(x),
                   "allgather": hvd.allgather(x), "broadcast": hvd.broadcast(x, root_rank=0),
                   "bf16": hvd.allreduce(tf.cast(x, tf.bfloat16), op=hvd.Sum), "function": traced(x)}
        out[mode] = {k: (tf.cast(v, tf.float32).numpy(), v.backing_device, v.dtype.name) for k, v in results.items()}
    out["x"] = x.numpy()
    hvd.shutdown()
    return out


def test_one_rank_on_a_real_gpu_returns_tf_tensors_on_that_gpu():
    """One worker (NCCL refuses two ranks on one GPU), under ``HORA_NCCL=require`` (every call on
    NCCL, or an error) then ``off``: allreduce Sum, Average, bfloat16, allgather, broadcast and a
    traced allreduce each give the right values; on NCCL they come back on the GPU."""
    reason = _gpu_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    env = clean_env({k: v for k, v in TF_ENV.items() if k != "CUDA_VISIBLE_DEVICES"})
    [out] = hora.run(_gpu_job, np=1, env=env, start_timeout=90)
    if "skip" in out:
        pytest.skip(out["skip"])
    x = out["x"]
    for mode in ("require", "off"):
        for key, (value, backing, dtype) in out[mode].items():
            np.testing.assert_array_equal(value, x, err_msg=f"{mode} {key}")
            assert dtype == ("bfloat16" if key == "bf16" else "float32"), (mode, key, dtype)
            if mode == "require":
                assert backing.endswith("GPU:0"), (key, backing)
