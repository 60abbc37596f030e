"""Negotiated engine items on the device path: real Signature/Response/Item/Request objects, the
recording CUDA/NCCL seam, and a communicator whose unique id goes through a real rendezvous server."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from nccl_fakes import CallLog, RecordingCuda, RecordingNccl  # noqa: E402 - after torch importorskip
from test_nccl_communicators import InitRecorder  # noqa: E402 - after torch importorskip

from hora.engine.coordinator import Response  # noqa: E402 - after torch importorskip
from hora.engine.executor import Item  # noqa: E402 - after torch importorskip
from hora.engine.request import Handle, Kind, Request, signature  # noqa: E402 - after torch importorskip
from hora.nccl.communicators import CommunicatorTable  # noqa: E402 - after torch importorskip
from hora.nccl.cudart import DEVICE_TO_HOST, HOST_TO_DEVICE  # noqa: E402 - after torch importorskip
from hora.nccl.device_tensor import DL_CUDA, DeviceBuffer, from_dlpack  # noqa: E402 - after torch importorskip
from hora.nccl.dispatch import DeviceExecutor, DeviceTensor, route  # noqa: E402 - after torch importorskip
from hora.nccl.ops import DeviceCollectives  # noqa: E402 - after torch importorskip
from hora.nccl.path import DEVICE, HOST  # noqa: E402 - after torch importorskip
from hora.rendezvous.auth import new_secret  # noqa: E402 - after torch importorskip
from hora.rendezvous.client import RendezvousClient  # noqa: E402 - after torch importorskip
from hora.rendezvous.server import RendezvousServer  # noqa: E402 - after torch importorskip
from hora.transport.base import ReduceOp  # noqa: E402 - after torch importorskip

pytestmark = pytest.mark.timeout(60)
STREAM = 7


class _Cai:
    def __init__(self, shape, typestr="<f4", ptr=0x10000):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, data=(ptr, False), strides=None,
                                             version=3, stream=STREAM)


def test_route_reads_device_and_dtype_of_real_and_interface_tensors():
    ready = lambda: (True, "ready")  # noqa: E731
    assert route(torch.ones(2), ReduceOp.SUM, "auto", ready).path == HOST
    assert route(_Cai((4,)), ReduceOp.SUM, "auto", ready).path == DEVICE
    assert route(_Cai((4,), "<i2"), ReduceOp.SUM, "auto", ready).path == HOST  # int16: no NCCL type
    assert route(_Cai((4,)), ReduceOp.SUM, "auto", lambda: (False, "no GPU")).reason.endswith("NCCL unusable (no GPU)")


def _device(shape, ptr, allocated):
    buf = DeviceBuffer(ptr, DL_CUDA, 0, np.dtype(np.float32), shape, True, STREAM)

    def allocate(out_shape):
        out = DeviceBuffer(0x900000 + len(allocated) * 0x10000, DL_CUDA, 0, np.dtype(np.float32), out_shape, True)
        allocated.append(out_shape)
        return ("framework tensor", out_shape), out

    return DeviceTensor(tensor=("input", ptr), buffer=buf, stream=STREAM, allocate=allocate)


def _item(kind, shape, dev, **response_fields):
    sig = signature(kind, "float32", shape, **{k: v for k, v in response_fields.items()
                                               if k in ("op", "root", "prescale", "postscale")})
    extra = {k: v for k, v in response_fields.items() if k in ("rows", "splits")}
    return Item(Response(f"t{dev.buffer.ptr:x}", sig, **extra), Request("t", sig, dev, Handle("t")))


@pytest.fixture
def executor():
    secret = new_secret()
    with RendezvousServer(secret) as server, RendezvousClient(*server.address, secret, connect_timeout=10) as store:
        log = CallLog()
        nccl = InitRecorder()
        table = CommunicatorTable(nccl, store, "round0", timeout=10)
        # global rank 1, the set's first member, publishes the set's id as its own process would
        first = InitRecorder()
        CommunicatorTable(first, store, "round0").get("set7", [1, 3], 1)
        nccl.published = first.inits[0][1]
        ops = DeviceCollectives(RecordingCuda(log), RecordingNccl(log), fusion_threshold=1 << 20)
        # this process is global rank 3, member 1 of a set of ranks [1, 3]
        yield DeviceExecutor(ops, table, "set7", [1, 3], 3), log, nccl


def test_items_run_in_negotiated_order_on_one_communicator(executor):
    ex, log, nccl = executor
    allocated, done = [], {}
    items = [
        _item(Kind.ALLREDUCE, (4,), _device((4,), 0x1000, allocated), op=ReduceOp.AVERAGE),
        _item(Kind.ALLREDUCE, (8,), _device((8,), 0x2000, allocated), op=ReduceOp.AVERAGE),
        _item(Kind.ALLGATHER, (2, 3), _device((2, 3), 0x3000, allocated), rows=(1, 2)),
        _item(Kind.BROADCAST, (5,), _device((5,), 0x4000, allocated), root=3),
        _item(Kind.ALLTOALL, (3,), _device((3,), 0x5000, allocated), splits=((1, 1), (2, 1))),
        _item(Kind.REDUCESCATTER, (5, 2), _device((5, 2), 0x6000, allocated), op=ReduceOp.SUM),
    ]
    ex.run(items, lambda item, result: done.setdefault(item.response.name, result))
    # the set's communicator was made once, as member 1 of 2, from the id the first member published
    assert nccl.inits == [(2, nccl.published, 1)]
    names = [c for c in log.names() if c not in ("event_create", "stream_create")]
    assert names[:2] == ["event_record", "stream_wait_event"] and names[-2:] == ["event_record", "stream_wait_event"]
    nccl_calls = [n for n in names if n in ("all_reduce", "all_gather", "broadcast", "send", "recv",
                                            "reduce_scatter", "reduce", "premul_sum", "op_destroy")]
    assert nccl_calls[:3] == ["premul_sum", "all_reduce", "op_destroy"]  # the two averages fused: one launch
    assert nccl_calls[3:] == ["broadcast", "broadcast", "broadcast", "send", "recv", "send", "recv", "reduce", "reduce"]
    average = next(c for c in log if c[0] == "premul_sum")
    assert average[1] == pytest.approx(0.5)
    bcast = [c for c in log if c[0] == "broadcast"][-1]
    assert bcast[1] == 0x4000 and bcast[5] == 1  # root rank 3 is member 1
    # allgather: 1+2 rows; alltoall: 1+1 rows received; reducescatter: 5 rows split 3+2, member 1 gets 2
    assert allocated == [(3, 3), (2,), (2, 2)]
    assert done["t1000"] == ("input", 0x1000) and done["t4000"] == ("input", 0x4000)
    out, recv_rows = done["t5000"]
    assert out == ("framework tensor", (2,)) and recv_rows.tolist() == [1, 1]


def test_the_first_member_publishes_and_the_second_needs_it(executor):
    ex, log, nccl = executor
    ex.members, ex.my_rank = [3, 1], 3  # now member 0: it makes the id
    done = {}
    ex.run([_item(Kind.BROADCAST, (2,), _device((2,), 0x1000, []), root=3)],
           lambda item, result: done.setdefault(item.response.name, result))
    assert nccl.inits and nccl.inits[0][0] == 2 and nccl.inits[0][2] == 0


def test_dlpack_buffer_of_a_real_tensor_feeds_the_executor_types():
    t = torch.arange(6, dtype=torch.float32)
    dev = DeviceTensor(t, from_dlpack(t), None, lambda shape: (None, None))
    assert dev.dtype == np.float32 and dev.shape == (6,)


def test_hierarchical_allreduce_uses_the_host_communicator_and_the_cross_host_ring(executor):
    ex, log, nccl = executor
    crossed = []
    ex.hierarchy = ([3], lambda host: crossed.append(host.size))  # this host holds rank 3 alone
    done = {}
    ex.run([_item(Kind.ALLREDUCE, (6,), _device((6,), 0x1000, []), op=ReduceOp.SUM),
            _item(Kind.ALLREDUCE, (2,), _device((2,), 0x2000, []), op=ReduceOp.SUM)],
           lambda item, result: done.setdefault(item.response.name, result))
    # the set's communicator, then the host's (member 0 of 1: it made the id itself)
    assert [(n, r) for n, _, r in nccl.inits] == [(2, 1), (1, 0)]
    calls = [c[0] for c in log if c[0] in ("reduce", "broadcast", "all_reduce")]
    assert calls == ["reduce", "broadcast", "reduce", "broadcast"]  # per tensor: into local rank 0, back out
    assert crossed == [6, 2]  # each tensor crossed hosts once, through host memory
    copies = [c[4] for c in log if c[0] == "memcpy"]
    assert copies.count(DEVICE_TO_HOST) == 2 and copies.count(HOST_TO_DEVICE) == 2
    assert done["t1000"] == ("input", 0x1000)
