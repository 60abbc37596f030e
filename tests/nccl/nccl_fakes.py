"""A recording CUDA runtime and NCCL for driving :mod:`hora.nccl.ops` without a GPU.

They implement the seam protocols (:class:`hora.nccl.cudart.CudaApi`, :class:`hora.nccl.ops.NcclCalls`)
by appending every call to one shared log, so a test reads the exact order hora issued them in.
Handles and pointers are distinct integers, as the real ones are.
"""

from __future__ import annotations

import itertools


class CallLog(list):
    def names(self) -> list[str]:
        return [call[0] for call in self]


class RecordingCuda:
    def __init__(self, log: CallLog) -> None:
        self.log = log
        self._ids = itertools.count(1000)

    def _new(self, kind: str) -> int:
        handle = next(self._ids)
        self.log.append((kind, handle))
        return handle

    def set_device(self, device): self.log.append(("set_device", device))
    def stream_create(self): return self._new("stream_create")
    def event_create(self): return self._new("event_create")
    def event_record(self, event, stream): self.log.append(("event_record", event, stream))
    def stream_wait_event(self, stream, event): self.log.append(("stream_wait_event", stream, event))
    def event_synchronize(self, event): self.log.append(("event_synchronize", event))

    def event_query(self, event):
        """Recorded work is "done" at once: nothing runs here."""
        self.log.append(("event_query", event))
        return True

    def malloc(self, nbytes): return self._new(f"malloc:{nbytes}")
    def free(self, ptr): self.log.append(("free", ptr))
    def memcpy_async(self, dst, src, nbytes, kind, stream): self.log.append(("memcpy", dst, src, nbytes, kind, stream))
    def pointer_device(self, ptr): return 0


class RecordingNccl:
    def __init__(self, log: CallLog) -> None:
        self.log = log
        self._ops = itertools.count(64)

    def group_start(self): self.log.append(("group_start",))
    def group_end(self): self.log.append(("group_end",))

    def premul_sum(self, scale, dtype, comm):
        op = next(self._ops)
        self.log.append(("premul_sum", scale, dtype, comm, op))
        return op

    def op_destroy(self, op, comm): self.log.append(("op_destroy", op, comm))
    def all_reduce(self, *a): self.log.append(("all_reduce",) + a)
    def reduce_scatter(self, *a): self.log.append(("reduce_scatter",) + a)
    def reduce(self, *a): self.log.append(("reduce",) + a)
    def all_gather(self, *a): self.log.append(("all_gather",) + a)
    def broadcast(self, *a): self.log.append(("broadcast",) + a)
    def send(self, *a): self.log.append(("send",) + a)
    def recv(self, *a): self.log.append(("recv",) + a)
