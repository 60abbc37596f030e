"""GPU TensorFlow tensors onto NCCL: what hora.tensorflow adds to the shared rule in :mod:`hora.device_requests`.

A concrete tensor (an EagerTensor: eagerly, or inside the Python body of a ``tf.py_function``) whose
memory is on a CUDA GPU is read in place through DLPack (``tf.experimental.dlpack.to_dlpack``: its
pointer, no host copy) and submitted as a device request; :mod:`hora.device_requests` then decides, as
for every binding, whether NCCL carries it (``HORA_NCCL``, the dtype, the op) or it takes the host
path. The callers (:mod:`hora.tensorflow.mpi_ops`, :mod:`hora.tensorflow.gradients`) fall back to
the host path when any tensor of a call cannot go, so a group stays one unit.

TensorFlow shapes this module in three ways:

- No stream hora can reach. TensorFlow runs a GPU's kernels on a compute stream it does not expose
  to Python, and its DLPack export does not wait for them (``TFE_HandleToDLPack`` only waits until
  the handle is ready, i.e. the kernel is enqueued). So before NCCL reads or writes, hora blocks the
  host until that stream is done (:func:`sync`: TensorFlow's ``SyncDevice`` op, as
  ``tf.test.experimental.sync_devices`` does), and passes no stream: the executor completes the
  handle only once hora's stream is done, so a result is complete when the caller gets it, and
  whatever TensorFlow enqueues on it next runs after NCCL.
- Results live in memory TensorFlow owns: ``tf.zeros`` on the input's device, then :func:`sync`,
  then NCCL writes into it. That is sound because (1) after the sync the zero-fill and every earlier
  kernel that used the memory (TensorFlow's allocator reuses freed memory in its stream's order) are
  done, (2) nobody else holds the new tensor until hora returns it, and hora returns it only after
  NCCL has finished, (3) the inputs and results are kept alive (the DLPack capsule holds a reference
  to TensorFlow's buffer) until then. A result whose shape is the input's (allreduce, broadcast) is
  made in the caller's thread, so one sync covers it and the inputs; a result whose shape negotiation
  decides (allgather, alltoall, reducescatter) is made by the engine and synced there.
- int32 tensors take the host path: on a GPU device TensorFlow keeps them in host memory by
  convention (most GPU kernels declare them ``HostMemory``), and ``tf.zeros`` would make an int32
  result there, where NCCL cannot write.

Where memory lives is read from the tensor's ``backing_device`` (``device`` names where the op ran,
which for int32 is not where the data is) through :func:`dlpack_device`, never from its data, so a
CPU job never loads CUDA or NCCL. Tests replace that one function to send CPU tensors down the device
path through the emulated NCCL.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora import basics, collectives, config, device_requests as submit
from hora.basics import ProcessSet
from hora.engine.request import Kind, Request
from hora.horovod_args import GradientReduction, partition
from hora.nccl import context
from hora.nccl.device_tensor import DL_CPU, DL_CUDA, DL_CUDA_MANAGED, DL_ROCM, DeviceBuffer, from_dlpack_capsule
from hora.nccl.path import DEVICE, choose_path, parse_mode
from hora.transport.base import ReduceOp

_CUDA_KINDS = (DL_CUDA, DL_CUDA_MANAGED)
#: A device DLPack has no type for (a TPU, ...): its tensors take the host path.
DL_NONE = 0
_REDUCING = (Kind.ALLREDUCE, Kind.REDUCESCATTER)
#: Results with the input's shape: made in the caller's thread, before the one sync of a call.
_SAME_SHAPE = (Kind.ALLREDUCE, Kind.BROADCAST)
#: Kept in host memory on TensorFlow's GPU devices (see the module docstring).
_HOST_DTYPES = (tf.int32,)


@functools.lru_cache(maxsize=1)
def _rocm() -> bool:
    return bool(tf.test.is_built_with_rocm())


def dlpack_device(device_name: str) -> tuple[int, int]:
    """``(DLPack device type, index)`` of memory on the TensorFlow device named ``device_name``
    (``'/job:localhost/replica:0/task:0/device:GPU:0'``; ``''`` is the host).

    The one place hora.tensorflow learns where memory lives: the tests replace it to send CPU
    tensors down the device path through the emulated NCCL (tests/nccl/nccl_emulation.py).
    """
    return _parsed(device_name or "")


@functools.lru_cache(maxsize=64)
def _parsed(device_name: str) -> tuple[int, int]:
    """:func:`dlpack_device`, once per name: every eager collective asks it of each of its tensors."""
    spec = tf.DeviceSpec.from_string(device_name)
    kind = (spec.device_type or "CPU").upper()
    index = int(spec.device_index or 0)
    if kind == "GPU":
        return (DL_ROCM if _rocm() else DL_CUDA), index
    return (DL_CPU if kind == "CPU" else DL_NONE), index


def _backing(tensor: Any) -> str | None:
    """The device holding a concrete tensor's memory; None for anything else (symbolic, NumPy)."""
    if not isinstance(tensor, tf.Tensor):
        return None
    try:
        return tensor.backing_device
    except (AttributeError, RuntimeError, ValueError):  # a graph tensor has no memory yet
        return None


def is_cuda(tensor: Any) -> bool:
    """Whether ``tensor`` is a concrete TensorFlow tensor in CUDA memory that NCCL could read."""
    name = _backing(tensor)
    return name is not None and tensor.dtype not in _HOST_DTYPES and dlpack_device(name)[0] in _CUDA_KINDS


def stages_on_device() -> bool:
    """Whether a collective traced now into a ``tf.function`` may take the device path when it runs:
    TensorFlow has a CUDA device and ``HORA_NCCL`` is not off. It is then staged as a
    ``tf.py_function``, whose body gets EagerTensors where the op runs (a GPU kernel keeps them in GPU
    memory); else as a ``tf.numpy_function``, whose body gets host copies."""
    if not any(dlpack_device(d.name)[0] in _CUDA_KINDS for d in tf.config.list_logical_devices()):
        return False
    return parse_mode(str(config.get("nccl"))) != "off"


def sync(device_name: str) -> None:
    """Block until every kernel TensorFlow has enqueued on ``device_name`` so far is done.

    TensorFlow does not expose its GPU stream, so this is the only ordering between its kernels and
    NCCL on hora's stream that pure Python has (see the module docstring).
    """
    from tensorflow.python.eager import context as tf_context
    from tensorflow.python.ops import gen_sync_ops

    with tf.device(device_name):
        gen_sync_ops.sync_device()
    if tf_context.context().is_async():  # the op itself was only queued
        tf_context.context().executor.wait()


def device_buffer(tensor: tf.Tensor) -> DeviceBuffer:
    """``tensor``'s memory through DLPack, in place (the capsule, which holds a reference to
    TensorFlow's buffer, and the tensor are kept alive with it). Device type and dtype are
    TensorFlow's: its word chose the path, and its DLPack export says uint8 for bool. The CUDA
    device is left to the CUDA runtime to read from the pointer (``device_id=-1``): TensorFlow
    numbers the GPUs it was let see, so after Horovod's usual
    ``tf.config.set_visible_devices(gpus[local_rank], 'GPU')`` its ``GPU:0`` (and its DLPack
    device id) is CUDA device ``local_rank``."""
    kind, index = dlpack_device(tensor.backing_device)
    capsule = tf.experimental.dlpack.to_dlpack(tensor)
    buffer = from_dlpack_capsule(capsule)
    return dataclasses.replace(buffer, device_type=kind, device_id=-1 if kind in _CUDA_KINDS else index,
                               dtype=np.dtype(tensor.dtype.as_numpy_dtype), keepalive=(capsule, tensor))


class Allocator(submit.PreparedAllocator):
    """New TensorFlow tensors for results, on the input's device. The caller syncs once for the whole
    call after :meth:`prepare`; a result the engine makes is synced here."""

    def __init__(self, like: tf.Tensor) -> None:
        super().__init__(tuple(like.shape))
        self.device = like.backing_device
        self.dtype = like.dtype

    def _made_by_engine(self, made: tuple[Any, DeviceBuffer]) -> tuple[Any, DeviceBuffer]:
        sync(self.device)  # NCCL writes into it next
        return made

    def _make(self, shape: tuple[int, ...]) -> tuple[tf.Tensor, DeviceBuffer]:
        with tf.device(self.device):
            out = tf.zeros(shape, self.dtype)
        if out.backing_device != self.device:  # NCCL would write where the pointer is not GPU memory
            raise TypeError(f"hora.tensorflow rank {basics.rank()}: TensorFlow made the {self.dtype.name} result on "
                            f"{out.backing_device}, not {self.device}")
        return out, device_buffer(out)


def takes_device(kind: Kind, tensor: Any, op: int = ReduceOp.SUM, prescale: float = 1.0,
                 postscale: float = 1.0) -> bool:
    """Whether ``tensor`` goes to NCCL (:func:`hora.nccl.path.choose_path`, which raises under
    ``HORA_NCCL=require`` when it cannot), decided before anything is named or allocated, so that a
    call whose tensors do not all go changes nothing before taking the host path."""
    if not is_cuda(tensor):
        return False
    reduces = kind in _REDUCING
    choice = choose_path(dlpack_device(tensor.backing_device), np.dtype(tensor.dtype.as_numpy_dtype),
                         ReduceOp(op) if reduces else None, parse_mode(str(config.get("nccl"))), context.ready,
                         scaled=reduces and (prescale != 1.0 or postscale != 1.0))
    return choice.path == DEVICE


def cuda_request(kind: Kind, tensor: tf.Tensor, name: str | None, process_set: ProcessSet,
                 **fields: Any) -> Request:
    """The device request of a tensor :func:`takes_device` accepted (no stream: see the module docstring)."""
    request = submit.cuda_request(kind, tensor, name, process_set, stream=None, allocate=Allocator(tensor),
                                  buffer=device_buffer(tensor), **fields)
    assert request is not None  # takes_device asked the same rule
    return request


def run(requests: Sequence[Request]) -> list[Any]:
    """Submit ``requests`` and wait: input-shaped results made first, then one sync per device, so
    NCCL finds the inputs written and the results' memory free. Each result is a TensorFlow tensor
    (an alltoall's, a pair with the received row counts)."""
    devices: dict[str, None] = {}
    for request in requests:
        allocate = request.buffer.allocate
        if request.signature.kind in _SAME_SHAPE:
            allocate.prepare()
        devices[allocate.device] = None
    for name in devices:
        sync(name)
    handles = collectives.submit_requests(list(requests))
    return [collectives.synchronize(handle) for handle in handles]


# ---- the collectives: each returns the results, or None for the host path ---------------------------

def _fields(op: int, prescale: float, postscale: float) -> dict[str, Any]:
    return {"op": ReduceOp(op), "prescale": float(prescale), "postscale": float(postscale)}


def _reduce(kind: Kind, tensors: Sequence[tf.Tensor], name: str | None, process_set: ProcessSet, grouped: bool,
            **fields: Any) -> list[tf.Tensor] | None:
    if not all(takes_device(kind, t, **fields) for t in tensors):
        return None
    if not grouped:
        return run([cuda_request(kind, tensors[0], name, process_set, **fields)])
    base, names = collectives.group_names(name, len(tensors), kind.value.lower(), process_set)
    return run([cuda_request(kind, t, n, process_set, group=base, group_size=len(tensors), **fields)
                for t, n in zip(tensors, names)])


def allreduce(tensors: Sequence[tf.Tensor], name: str | None, op: int, prescale: float, postscale: float,
              process_set: ProcessSet, grouped: bool) -> list[tf.Tensor] | None:
    """Allreduce (one tensor, or a group as one unit) on NCCL, or None."""
    return _reduce(Kind.ALLREDUCE, tensors, name, process_set, grouped, **_fields(op, prescale, postscale))


def reducescatter(tensors: Sequence[tf.Tensor], name: str | None, op: int, prescale: float, postscale: float,
                  process_set: ProcessSet, grouped: bool) -> list[tf.Tensor] | None:
    """Reducescatter (one tensor, or a group as one unit) on NCCL, or None."""
    return _reduce(Kind.REDUCESCATTER, tensors, name, process_set, grouped, **_fields(op, prescale, postscale))


def allgather(tensors: Sequence[tf.Tensor], name: str | None, process_set: ProcessSet,
              grouped: bool) -> list[tf.Tensor] | None:
    """Allgather on NCCL, or None. A scalar gathers as one row, as on the host path."""
    rows = [tf.reshape(t, [1]) if t.shape.rank == 0 else t for t in tensors]
    return _reduce(Kind.ALLGATHER, rows, name, process_set, grouped)


def broadcast(tensor: tf.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> list[tf.Tensor] | None:
    """``root_rank``'s tensor on NCCL, or None."""
    if not takes_device(Kind.BROADCAST, tensor):
        return None
    collectives.check_root(root_rank, process_set)
    return run([cuda_request(Kind.BROADCAST, tensor, name, process_set, root=int(root_rank))])


def alltoall(tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None,
             process_set: ProcessSet) -> list[tf.Tensor] | None:
    """Alltoall on NCCL, or None: the received rows and, as int64, how many came from each rank."""
    if not takes_device(Kind.ALLTOALL, tensor):
        return None
    split_list = collectives.alltoall_splits(tuple(tensor.shape), None if splits is None else splits.numpy(),
                                             process_set)
    [(output, received)] = run([cuda_request(Kind.ALLTOALL, tensor, name, process_set, splits=tuple(split_list))])
    return [output, tf.constant(np.asarray(received, np.int64))]


def reduce_gradients(tensors: Sequence[tf.Tensor | None], names: Sequence[str | None],
                     reduction: GradientReduction,
                     groups: int | list[list[int]] | None = None) -> list[tf.Tensor | None] | None:
    """A dense gradient list on NCCL as :func:`hora.binding.batched.start` sends it on the host path (the same
    names, the same groups), or None when any gradient cannot go."""
    present = [i for i, t in enumerate(tensors) if t is not None]
    fields = _fields(reduction.op, reduction.prescale_factor, reduction.postscale_factor)
    if not present or not all(takes_device(Kind.ALLREDUCE, tensors[i], **fields) for i in present):
        return None
    ps = reduction.process_set
    named = [n if n is not None else basics.next_name("allreduce", ps) for n in names]
    requests: list[Request] = []
    order: list[int] = []
    for unit in partition(present, groups):
        if len(unit) == 1:
            requests.append(cuda_request(Kind.ALLREDUCE, tensors[unit[0]], named[unit[0]], ps, **fields))
        else:
            base, unit_names = collectives.group_names(f"{named[unit[0]]}.group", len(unit), "allreduce", ps)
            requests += [cuda_request(Kind.ALLREDUCE, tensors[i], n, ps, group=base, group_size=len(unit), **fields)
                         for i, n in zip(unit, unit_names)]
        order += unit
    out: list[tf.Tensor | None] = [None] * len(tensors)
    for i, result in zip(order, run(requests)):
        out[i] = result
    return out
