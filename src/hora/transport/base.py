"""The transport interface: collectives on contiguous buffers among a fixed set of processes.

A transport decides *how* bytes move and are combined, never *what* is reduced: the engine above
hands it flat NumPy arrays and a reduce op. Every implementation passes the same conformance suite
(tests/transport/), so the contract below is what the engine may rely on.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from hora.errors import HoraError
from hora.transport.scaling import scale_into


class ReduceOp(enum.IntEnum):
    """How buffers combine: the one reduce-op type from the API (``hvd.Sum is ReduceOp.SUM``) down to here.

    The values are Horovod's, so scripts that store or compare ``hvd.Average`` and friends as ints
    keep working. AVERAGE and ADASUM never reach a transport (the engine runs an Average as a Sum
    plus a postscale of 1/size); transports implement :data:`ELEMENTWISE_OPS`.
    """

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5
    BAND = 6  # bitwise and: the engine's response-cache bit vectors
    BOR = 7

    def __str__(self) -> str:
        return self.name.lower()


#: The ops every transport implements element-wise.
ELEMENTWISE_OPS: tuple[ReduceOp, ...] = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT, ReduceOp.BAND,
                                         ReduceOp.BOR)


SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        np.uint8,
        np.int8,
        np.int16,
        np.uint16,
        np.int32,
        np.int64,
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.float64,
        np.bool_,
    )
)


def check_buffer(buf: np.ndarray, what: str = "buffer") -> None:
    """Reject buffers a transport cannot move without a hidden copy or a silent reinterpretation."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, got {type(buf).__name__}")
    if buf.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{what} has dtype {buf.dtype}, which hora transports do not support; "
            f"supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (call numpy.ascontiguousarray first)")


def check_counts(counts: Sequence[int], size: int, what: str) -> list[int]:
    values = [int(c) for c in counts]
    if len(values) != size:
        raise ValueError(f"{what} must have one entry per rank ({size}), got {len(values)}")
    if any(c < 0 for c in values):
        raise ValueError(f"{what} must be non-negative, got {values}")
    return values


def check_root(root: int, size: int) -> None:
    """Reject a root that is not a member index of a communicator of ``size``."""
    if not 0 <= int(root) < size:
        raise ValueError(f"root {root} is not a rank of this communicator (size {size})")


class Communicator(abc.ABC):
    """Collectives among ``size`` processes; this process is ``rank``.

    Buffers are contiguous 1-D-or-any-shape NumPy arrays treated as flat element sequences. Calls are
    collective: every member calls the same operation in the same order. Calls on one communicator
    must not overlap (the engine serialises them). A failed peer makes every call raise
    :class:`hora.errors.TransportError` within the transport timeout instead of hanging.
    """

    #: Registry name, e.g. "tcp".
    name: str = ""

    # ---- optional capabilities: declared here with their defaults, so callers use them directly ----

    #: Label of this transport's collectives in the timeline (what Horovod shows for its own ring).
    activity: str = "RING"
    #: Whether :meth:`allocate` hands out the transport's own memory (a shared-memory segment, say),
    #: on which collectives skip copying in; False means it returns ordinary memory, so a caller that
    #: keeps its own buffers gains nothing by asking.
    allocates_own_memory: bool = False
    #: Smallest lone buffer worth copying into :meth:`allocate`'s memory before a collective (smaller
    #: ones are copied by the transport anyway). Meaningful only with ``allocates_own_memory``.
    staged_min_bytes: int = 0
    #: Whether :meth:`allreduce_into` saves copies over copying into ``dst`` and reducing it in place
    #: (shared memory reads each rank's own share straight from ``src``); the engine then hands lone
    #: tensors to it instead of staging them.
    reduces_into: bool = False

    def allreduce_into(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp = ReduceOp.SUM,
                       postscale: float = 1.0) -> None:
        """:meth:`allreduce` out of place: ``dst`` (``src`` itself for in place) receives the result,
        multiplied by ``postscale`` with Horovod's rounding (:func:`hora.transport.scaling.scale_into`)."""
        if dst is not src:
            dst[...] = src
        self.allreduce(dst, op)
        scale_into(dst, postscale, dst)

    def allocate(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` that collectives on this communicator move fastest.

        Every member must call it with the same size at the same point (a transport may need to
        agree on new memory with its peers). A later call may return the same memory: use one
        buffer at a time.
        """
        return np.empty(nbytes, dtype=np.uint8)

    @property
    def global_rank(self) -> int:
        """This process's rank in the job, for messages (``rank`` is its index in this communicator)."""
        return self.rank

    @property
    def bytes_sent(self) -> int | None:
        """Bytes this rank has handed to its sockets for peers through this communicator, every
        collective and negotiation included: the traffic a setting costs, counted where it leaves,
        not estimated. ``None`` where the transport cannot count them (MPI sends inside its library).
        Shared memory between ranks of one host moves no network bytes and is not counted."""
        return None

    # ---- the collectives ------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> None:
        """Combine ``buf`` element-wise across ranks, in place, on every rank."""

    @abc.abstractmethod
    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``send`` (``counts[r]`` elements from rank r) into ``recv``."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy ``root``'s ``buf`` into ``buf`` on every rank."""

    @abc.abstractmethod
    def alltoall(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> None:
        """Send ``send_counts[j]`` consecutive elements to rank j; receive ``recv_counts[j]`` from j.

        Both buffers are laid out in rank order.
        """

    @abc.abstractmethod
    def reducescatter(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: ReduceOp = ReduceOp.SUM
    ) -> None:
        """Reduce ``send`` across ranks and leave block r (``counts[r]`` elements) in rank r's ``recv``."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return only once every rank has entered the barrier."""

    @abc.abstractmethod
    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Collect a small picklable object from every rank at ``root`` (None elsewhere)."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s small picklable object, on every rank."""

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's small picklable object, in rank order, on every rank."""
        gathered: list[Any] = self.broadcast_object(self.gather_object(obj, 0), 0)
        return gathered

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets and threads; later calls raise."""

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TransportUnavailable(HoraError):
    """The requested transport cannot run here (library missing, no device, ...)."""


class MemberCommunicator(Communicator):
    """A communicator over an explicit list of the job's ranks (``_members``), this process being
    member ``_rank``: the identity every point-to-point transport shares."""

    _rank: int
    _members: list[int]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._members)

    @property
    def global_rank(self) -> int:
        return self._members[self._rank]

