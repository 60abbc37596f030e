"""What a binding submits to the engine, and the handle it gets back.

A :class:`Request` carries the local buffer plus a :class:`Signature`: the part every rank must agree
on (op, dtype, shape rules, root, scales, process set). Only signatures travel to the coordinator;
buffers never leave the rank except through the transport.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import ml_dtypes
import numpy as np

from hora.transport.base import ReduceOp


class Kind(str, enum.Enum):
    ALLREDUCE = "ALLREDUCE"
    ALLGATHER = "ALLGATHER"
    BROADCAST = "BROADCAST"
    ALLTOALL = "ALLTOALL"
    REDUCESCATTER = "REDUCESCATTER"
    BARRIER = "BARRIER"
    JOIN = "JOIN"
    # Process-set changes, negotiated on the global set so that every rank acts at the same point.
    ADD_PROCESS_SET = "ADD_PROCESS_SET"
    REMOVE_PROCESS_SET = "REMOVE_PROCESS_SET"


#: Requests that change the process sets (see :func:`process_set_signature`).
PROCESS_SET_KINDS = frozenset((Kind.ADD_PROCESS_SET, Kind.REMOVE_PROCESS_SET))


@dataclass(frozen=True, eq=False)
class Signature:
    """The facts about a request that must match across ranks (shape per the collective's rules).

    Build them with :func:`signature`, which returns one shared object per distinct value: a
    training step submits the same signatures every step, and comparing them (the response cache
    does, per tensor per step) is then an identity check.
    """

    kind: Kind
    dtype: str
    shape: tuple[int, ...]
    op: ReduceOp = ReduceOp.SUM  # AVERAGE runs as SUM plus a postscale of 1/size
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    group: str = ""  # members of a grouped collective share this and travel as one unit
    group_size: int = 0
    splits: tuple[int, ...] = ()  # alltoall: elements... rows this rank sends to each member
    set_ranks: tuple[int, ...] = ()  # ADD_PROCESS_SET: the new set's ranks
    set_id: int = -1  # REMOVE_PROCESS_SET: the set to remove
    #: "" for the host path (the CPU transports), "cuda" for NCCL on the device (hora.nccl.path):
    #: part of the signature so that ranks which chose different paths fail negotiation, naming both.
    device: str = ""
    #: Every member takes part, joined or not (see :func:`hora.basics` join): a joined rank submits it
    #: too, with its own data, and negotiation waits for it. Sharded optimizers use it so that a rank
    #: out of data still steps its shard of the state.
    through_join: bool = False

    @cached_property
    def _key(self) -> tuple[object, ...]:
        return (self.kind, self.dtype, self.shape, self.op, self.root, self.prescale, self.postscale,
                self.group, self.group_size, self.splits, self.set_ranks, self.set_id, self.device,
                self.through_join)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Signature:
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __reduce__(self) -> tuple[Any, ...]:
        # Negotiation pickles signatures every round. Only the fields travel (not the cached
        # properties), as plain values, and the receiver gets the interned object back, so the
        # coordinator's and the cache's comparisons stay identity checks.
        return (_unpickle_signature, (self.kind.value, self.dtype, self.shape, int(self.op), self.root,
                                      self.prescale, self.postscale, self.group, self.group_size, self.splits,
                                      self.set_ranks, self.set_id, self.device, self.through_join))

    @cached_property
    def count(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @cached_property
    def row_count(self) -> int:
        """Elements per index of the first dimension."""
        return math.prod(self.shape[1:])

    @cached_property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def nbytes(self) -> int:
        return self.count * self.np_dtype.itemsize


_INTERNED: dict[tuple[object, ...], Signature] = {}
_INTERN_LIMIT = 1 << 16  # distinct signatures kept; past it the table starts over (no leak)


def signature(kind: Kind, dtype: str, shape: tuple[int, ...], op: ReduceOp = ReduceOp.SUM, root: int = -1,
              prescale: float = 1.0, postscale: float = 1.0, group: str = "", group_size: int = 0,
              splits: tuple[int, ...] = (), device: str = "", through_join: bool = False) -> Signature:
    """The shared :class:`Signature` with these fields (created on first use)."""
    key = (kind, dtype, shape, op, root, prescale, postscale, group, group_size, splits, device, through_join)
    sig = _INTERNED.get(key)
    if sig is None:
        if len(_INTERNED) >= _INTERN_LIMIT:
            _INTERNED.clear()
        sig = _INTERNED[key] = Signature(*key[:10], device=device, through_join=through_join)
    return sig


def with_through_join(sig: Signature) -> Signature:
    """``sig`` with ``through_join`` set (interned like any other)."""
    if sig.through_join:
        return sig
    return signature(sig.kind, sig.dtype, sig.shape, sig.op, sig.root, sig.prescale, sig.postscale, sig.group,
                     sig.group_size, sig.splits, sig.device, True)


_KINDS = {kind.value: kind for kind in Kind}
_OPS = {int(op): op for op in ReduceOp}


def _unpickle_signature(kind: str, dtype: str, shape: tuple[int, ...], op: int, root: int, prescale: float,
                        postscale: float, group: str, group_size: int, splits: tuple[int, ...],
                        set_ranks: tuple[int, ...], set_id: int, device: str, through_join: bool) -> Signature:
    if set_ranks or set_id >= 0:  # process-set changes are not interned (see process_set_signature)
        return Signature(_KINDS[kind], dtype, shape, _OPS[op], root, prescale, postscale, group, group_size,
                         splits, set_ranks, set_id, device, through_join)
    return signature(_KINDS[kind], dtype, shape, _OPS[op], root, prescale, postscale, group, group_size, splits,
                     device, through_join)


def process_set_signature(ranks: tuple[int, ...] = (), set_id: int = -1) -> Signature:
    """The signature of adding a process set of ``ranks``, or (with ``set_id``) of removing one.

    These carry no tensor and are rare, so they are built fresh rather than interned.
    """
    if set_id >= 0:
        return Signature(Kind.REMOVE_PROCESS_SET, "uint8", (), set_id=set_id)
    return Signature(Kind.ADD_PROCESS_SET, "uint8", (), set_ranks=tuple(ranks))


_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """The dtype's name (``dtype.name`` is slow enough to matter on the submission path)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = "bfloat16" if dtype == ml_dtypes.bfloat16 else dtype.name
    return name


#: When a thread last started blocking on a handle (``time.perf_counter``). The engine reads it to
#: tell that a burst of submissions is over: a thread that waits submits nothing more for now.
last_wait_started = 0.0


#: Longest single block in :meth:`Handle.wait` before it checks on the engine again (seconds).
_RECHECK_S = 1.0


def mark_waiting() -> None:
    global last_wait_started
    last_wait_started = time.perf_counter()


class Handle:
    """The future of one request; the binding waits on it (``synchronize``) or polls it."""

    __slots__ = ("name", "_finished", "_gate", "_result", "_error", "driver", "__weakref__")

    def __init__(self, name: str) -> None:
        self.name = name
        self._finished = False
        #: Set by the engine on submission: a waiting thread lends itself to run the engine's
        #: cycles (``driver.drive(handle)``) instead of sleeping while another thread does.
        self.driver: Any = None
        # A held lock is the cheapest one-shot signal: released once on completion; each waiter
        # acquires and re-releases it. (threading.Event costs several times more to create.)
        self._gate = threading.Lock()
        self._gate.acquire()
        self._result: Any = None
        self._error: BaseException | None = None

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._gate.release()

    def set_result(self, result: Any) -> None:
        self._result = result
        self._finish()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def done(self) -> bool:
        return self._finished

    def wait_done(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for completion, without the result; True once done."""
        if self._finished:
            return True
        if self._gate.acquire(timeout=timeout):
            self._gate.release()
            return True
        return False

    def wait(self, timeout: float | None = None) -> Any:
        """The result; raises the request's error in the caller's thread, where it can be handled."""
        if not self._finished:
            if timeout is None and self.driver is not None:
                self.driver.drive(self)  # stamps last_wait_started once it counts as a driver
            else:
                mark_waiting()
            if not self._finished:
                self._await(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def _await(self, timeout: float | None) -> None:
        """Block until done, in bounded waits that ask the engine between them whether it can still
        complete this handle: an engine that stopped fails it, so no wait outlives its engine."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = _RECHECK_S if deadline is None else max(0.0, min(_RECHECK_S, deadline - time.monotonic()))
            if self._gate.acquire(timeout=step):
                self._gate.release()
                return
            driver = self.driver
            if driver is not None and driver.abandon_if_stopped(self):
                continue  # failed just now: the next acquire returns at once
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"request {self.name!r} did not complete within {timeout} s")


class Request:
    """One tensor's collective on this rank.

    ``buffer`` is the input: a numpy array on the host path, a :class:`hora.nccl.dispatch.DeviceTensor`
    on the device path (``signature.device == "cuda"``), None for a request that carries no tensor
    (join, barrier, process-set changes).
    """

    __slots__ = ("name", "signature", "buffer", "handle", "process_set_id", "output", "submitted_at", "donated")

    def __init__(self, name: str, signature: Signature, buffer: Any, handle: Handle,
                 process_set_id: int = 0, output: np.ndarray | None = None, submitted_at: float = 0.0) -> None:
        self.name = name
        self.signature = signature
        self.buffer = buffer
        self.handle = handle
        self.process_set_id = process_set_id
        self.output = output  # allreduce/broadcast: where the result goes (may be buffer)
        self.submitted_at = submitted_at
        #: The caller gave ``buffer`` up (a temporary it packed for this collective): the engine may
        #: scale it in place and hand it to the transport as it is, instead of copying it first.
        self.donated = False

    def __repr__(self) -> str:
        return f"Request({self.name!r}, {self.signature!r}, process_set_id={self.process_set_id})"
