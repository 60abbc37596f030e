"""The device collectives' call sequences, driven through the CUDA/NCCL seam (no GPU needed).

What is checked is what a GPU cannot show by itself: hora's stream waits on an event recorded on
the framework's stream before any copy or NCCL call, the framework's stream waits on hora's done
event after the last one, nothing waits on the host except the hierarchical cross-host copy, the
fusion buffer's layout, the scale folded into one pre-multiplied Sum, and the grouped forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from nccl_fakes import CallLog, RecordingCuda, RecordingNccl

from hora.nccl.communicators import DeviceComm
from hora.nccl.cudart import DEVICE_TO_DEVICE, DEVICE_TO_HOST, HOST_TO_DEVICE
from hora.nccl.library import DataType, RedOp
from hora.nccl.ops import DeviceCollectives, combined_scale
from hora.transport.base import ReduceOp

pytestmark = pytest.mark.timeout(60)

FRAMEWORK_STREAM = 7
COMM = DeviceComm("global", comm=0xC0, rank=1, size=4, epoch=0)


@dataclass
class Buf:
    ptr: int
    dtype: np.dtype
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * np.dtype(self.dtype).itemsize


@pytest.fixture
def setup():
    log = CallLog()
    ops = DeviceCollectives(RecordingCuda(log), RecordingNccl(log), fusion_threshold=4096)
    log.clear()
    return ops, log


def test_ordering_is_event_based_with_no_host_wait(setup):
    ops, log = setup
    done = ops.run(FRAMEWORK_STREAM, FRAMEWORK_STREAM,
                   lambda: ops.allreduce(COMM, [Buf(0x1000, np.float32, 1 << 20)], ReduceOp.SUM))
    names = log.names()
    # the entry event is recycled for "done" at once: hora's stream already waits on its record
    assert names == ["event_create", "event_record", "stream_wait_event", "all_reduce",
                     "event_record", "stream_wait_event"]
    enter_event = log[0][1]
    assert log[1] == ("event_record", enter_event, FRAMEWORK_STREAM)
    assert log[2] == ("stream_wait_event", ops.stream, enter_event)
    assert log[3][-1] == ops.stream  # NCCL runs on hora's own stream, not the framework's
    assert log[4] == ("event_record", done, ops.stream) and done == enter_event
    assert log[5] == ("stream_wait_event", FRAMEWORK_STREAM, done)
    assert "event_synchronize" not in names


def test_events_are_reused_so_a_long_training_creates_a_bounded_number(setup):
    ops, log = setup
    for _ in range(50):
        start = ops.mark()
        done = ops.run(FRAMEWORK_STREAM, FRAMEWORK_STREAM,
                       lambda: ops.allreduce(COMM, [Buf(0x1000, np.float32, 1 << 20)], ReduceOp.SUM))
        ops.recycle(start, done)  # what the executor does once the GPU has done the run
    assert log.names().count("event_create") == 2  # a start marker and one event for the rest
    assert log.names().count("all_reduce") == 50


def test_framework_without_stream_gets_the_done_event_only(setup):
    ops, log = setup
    done = ops.run(FRAMEWORK_STREAM, None, lambda: ops.broadcast(COMM, Buf(0x10, np.float16, 8), root=2))
    assert log[-1] == ("event_record", done, ops.stream)
    assert ("broadcast", 0x10, 0x10, 8, DataType.FLOAT16, 2, COMM.comm, ops.stream) in log


def test_small_tensors_are_fused_on_the_device_and_copied_back(setup):
    ops, log = setup
    tensors = [Buf(0x100, np.float32, 25), Buf(0x900, np.float32, 75)]  # 100 and 300 bytes
    ops.allreduce(COMM, tensors, ReduceOp.SUM)
    fusion_ptr = next(call[1] for call in log if call[0].startswith("malloc:"))
    assert log[0][0] == "malloc:768"  # the bucket's aligned size: 256 + 300 rounded up to 256s
    copies_in = [c for c in log if c[0] == "memcpy" and c[1] >= fusion_ptr and c[1] < fusion_ptr + 768]
    assert [(c[1] - fusion_ptr, c[2], c[3], c[4]) for c in copies_in] == [(0, 0x100, 100, DEVICE_TO_DEVICE),
                                                                       (256, 0x900, 300, DEVICE_TO_DEVICE)]
    reduce_call = next(c for c in log if c[0] == "all_reduce")
    assert reduce_call[1:6] == (fusion_ptr, fusion_ptr, 192, DataType.FLOAT32, RedOp.SUM)
    copies_out = [c for c in log if c[0] == "memcpy" and fusion_ptr <= c[2] < fusion_ptr + 768]
    assert [(c[1], c[2] - fusion_ptr, c[3]) for c in copies_out] == [(0x100, 0, 100), (0x900, 256, 300)]
    assert log.names().index("all_reduce") > log.names().index("memcpy")
    # a second step reuses the buffer: no new allocation
    log.clear()
    ops.allreduce(COMM, tensors, ReduceOp.SUM)
    assert not [c for c in log if c[0].startswith("malloc")]


def test_growing_the_fusion_buffer_waits_for_hora_stream_before_freeing(setup):
    ops, log = setup
    ops.allreduce(COMM, [Buf(0x100, np.float32, 4), Buf(0x200, np.float32, 4)], ReduceOp.SUM)
    first = ops._fusion_ptr
    log.clear()
    ops.allreduce(COMM, [Buf(0x100, np.float32, 300), Buf(0x2000, np.float32, 300)], ReduceOp.SUM)
    names = log.names()
    assert names.index("event_synchronize") < names.index("free") and ("free", first) in log


def test_average_prescale_postscale_fold_into_one_premul_sum(setup):
    ops, log = setup
    ops.allreduce(COMM, [Buf(0x1000, np.float32, 1 << 20)], ReduceOp.AVERAGE, prescale=2.0, postscale=3.0)
    premul = next(c for c in log if c[0] == "premul_sum")
    assert premul[1] == pytest.approx(2.0 * 3.0 / 4) and premul[2] == DataType.FLOAT32
    op = premul[4]
    names = log.names()
    assert names.index("premul_sum") < names.index("all_reduce") < names.index("op_destroy")
    assert next(c for c in log if c[0] == "all_reduce")[5] == op and ("op_destroy", op, COMM.comm) in log
    assert combined_scale(ReduceOp.SUM, 1.0, 1.0, 8) == 1.0


def test_scaled_max_is_refused_and_unscaled_ops_use_builtins(setup):
    ops, log = setup
    with pytest.raises(ValueError, match="host path"):
        ops.allreduce(COMM, [Buf(0x1000, np.float32, 1 << 20)], ReduceOp.MAX, prescale=2.0)
    ops.allreduce(COMM, [Buf(0x1000, np.int64, 1 << 20)], ReduceOp.MIN)
    call = [c for c in log if c[0] == "all_reduce"][-1]
    assert call[4:6] == (DataType.INT64, RedOp.MIN) and "premul_sum" not in log.names()


def test_allgather_even_uses_ncclallgather_uneven_uses_grouped_broadcasts(setup):
    ops, log = setup
    ops.allgather(COMM, Buf(0x10, np.float32, 3), Buf(0x1000, np.float32, 12), [3, 3, 3, 3])
    assert log[-1] == ("all_gather", 0x10, 0x1000, 3, DataType.FLOAT32, COMM.comm, ops.stream)
    log.clear()
    ops.allgather(COMM, Buf(0x10, np.float32, 2), Buf(0x1000, np.float32, 6), [1, 2, 0, 3])
    assert log.names() == ["group_start"] + ["broadcast"] * 4 + ["group_end"]
    sends = [(c[1], c[2], c[3], c[5]) for c in log if c[0] == "broadcast"]
    assert sends == [(0x1000, 0x1000, 1, 0), (0x10, 0x1004, 2, 1), (0x100C, 0x100C, 0, 2), (0x100C, 0x100C, 3, 3)]


def test_alltoall_is_one_group_of_sends_and_receives(setup):
    ops, log = setup
    ops.alltoall(COMM, Buf(0x100, np.float64, 6), [1, 2, 0, 3], Buf(0x900, np.float64, 5), [2, 2, 1, 0])
    assert log[0] == ("group_start",) and log[-1] == ("group_end",)
    sends = [(c[1], c[2], c[4]) for c in log if c[0] == "send"]
    recvs = [(c[1], c[2], c[4]) for c in log if c[0] == "recv"]
    assert sends == [(0x100, 1, 0), (0x108, 2, 1), (0x118, 3, 3)]  # nothing sent to member 2
    assert recvs == [(0x900, 2, 0), (0x910, 2, 1), (0x920, 1, 2)]  # nothing received from member 3


def test_reducescatter_even_and_uneven(setup):
    ops, log = setup
    ops.reducescatter(COMM, Buf(0x100, np.float32, 8), Buf(0x900, np.float32, 2), [2, 2, 2, 2], ReduceOp.SUM)
    assert log[-1] == ("reduce_scatter", 0x100, 0x900, 2, DataType.FLOAT32, RedOp.SUM, COMM.comm, ops.stream)
    log.clear()
    ops.reducescatter(COMM, Buf(0x100, np.float32, 7), Buf(0x900, np.float32, 2), [2, 2, 2, 1], ReduceOp.AVERAGE)
    reduces = [(c[1], c[3], c[6]) for c in log if c[0] == "reduce"]
    assert reduces == [(0x100, 2, 0), (0x108, 2, 1), (0x110, 2, 2), (0x118, 1, 3)]
    assert log.names()[0] == "premul_sum" and log.names()[-1] == "op_destroy"


def test_grouped_runs_calls_inside_one_group(setup):
    ops, log = setup
    ops.grouped([lambda: ops.broadcast(COMM, Buf(0x10, np.int32, 4), 0),
                 lambda: ops.broadcast(COMM, Buf(0x20, np.int32, 4), 0)])
    assert log.names() == ["group_start", "broadcast", "broadcast", "group_end"]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_hierarchical_reduces_in_host_crosses_hosts_on_host_memory_and_broadcasts(setup, local_rank):
    ops, log = setup
    local = DeviceComm("local", comm=0xAA, rank=local_rank, size=2, epoch=0)
    crossed = []
    ops.hierarchical_allreduce(local, Buf(0x4000, np.float32, 16), ReduceOp.AVERAGE,
                               lambda host: crossed.append(host.shape), world_size=4)
    names = log.names()
    premul = next(c for c in log if c[0] == "premul_sum")
    assert premul[1] == pytest.approx(0.25) and premul[3] == 0xAA
    reduce_call = next(c for c in log if c[0] == "reduce")
    assert reduce_call[6:8] == (0, 0xAA)  # to local rank 0 on the host-local communicator
    assert names[-1] == "broadcast"
    if local_rank == 0:
        kinds = [c[4] for c in log if c[0] == "memcpy"]
        assert kinds == [DEVICE_TO_HOST, HOST_TO_DEVICE] and crossed == [(16,)]
        # the host copy waits on hora's stream only: the synchronised events were recorded there
        synced = {c[1] for c in log if c[0] == "event_synchronize"}
        assert synced and all(("event_record", e, ops.stream) in log for e in synced)
        assert names.index("reduce") < names.index("memcpy") < names.index("broadcast")
    else:
        assert crossed == [] and "memcpy" not in names and "event_synchronize" not in names


def test_close_frees_the_fusion_buffer_after_draining(setup):
    ops, log = setup
    ops.allreduce(COMM, [Buf(0x100, np.float32, 4), Buf(0x200, np.float32, 4)], ReduceOp.SUM)
    ptr = ops._fusion_ptr
    log.clear()
    ops.close()
    assert log.names()[-2:] == ["event_synchronize", "free"] and log[-1] == ("free", ptr)
