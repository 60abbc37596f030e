"""The MPI transport (``HORA_TRANSPORT=mpi``): hora's collectives through mpi4py's buffer interface.

The MPI library moves and reduces the bytes (Open MPI's tuned collectives, its shared-memory and
network layers); hora keeps its engine, negotiation and fusion above it. Ranks are hora's world
ranks, which are ranks of the communicator the world was formed over (``MPI_COMM_WORLD`` under
``mpirun``, or ``init(comm=...)``'s); each hora communicator (the world, each process set) gets its
own MPI communicator (``Dup`` for all ranks, ``Create_group`` for a subset, so only members call it).

Elements travel as a contiguous MPI datatype of their size, so any of hora's dtypes moves without
conversion. Reductions use MPI's built-in ops where MPI defines them on the dtype (integers,
float32/float64), and an MPI user op written with NumPy for float16, bfloat16 and bool.

MPI has no bounded wait, and Open MPI's shared-memory path never notices a peer that died. So
every collective is started non-blocking and polled, and between polls the rank watches a
*lifeline*: one authenticated socket to every other member (hora's TCP mesh, carrying no data). A
peer that dies closes its lifelines, and every survivor raises :class:`PeerFailureError` naming its
rank within milliseconds, before ``mpirun`` (which ends the whole job when one process dies) kills
them. A peer that stays alive but makes no progress fails the collective after
``HORA_TRANSPORT_TIMEOUT`` seconds, as the built-in transports do.
"""

from __future__ import annotations

import pickle
import select
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from hora import config
from hora.errors import PeerFailureError, TransportError
from hora.rendezvous.auth import secret_bytes
from hora.rendezvous.client import RendezvousClient
from hora.transport import mpi_world as state
from hora.transport.base import (
    MemberCommunicator,
    ReduceOp,
    TransportUnavailable,
    check_buffer,
    check_counts,
    check_root,
)
from hora.transport.guard import CollectiveGuard
from hora.transport.reduce import check_op, reduction_ufunc
from hora.transport.tcp_mesh import connect_mesh, route_address

_SPIN_TESTS = 64  # Test() calls before the first wait on the lifelines
_POLL_S = 0.0005
_GOODBYE = b"\x01"  # the one byte a lifeline ever carries: sent by close()


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except Exception as exc:  # ImportError, or a missing MPI library
        raise TransportUnavailable(f"the mpi transport needs mpi4py and an MPI library: {exc}") from None
    return MPI


_INSTALL = 'pip install "hora[mpi]"'
_REINSTALL = "reinstall mpi4py: pip install --force-reinstall --no-cache-dir mpi4py"
#: How long the child that loads mpi4py's MPI library may take: one stuck (a hung network file
#: system, a misconfigured PMI) must not stall the launcher or ``hora check``.
_PROBE_TIMEOUT_S = 30.0
# Loads the library without MPI_Init: the probe must not need (or wait for) an MPI launcher.
_PROBE = "import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; from mpi4py import MPI"


def unavailable_reason(timeout: float = _PROBE_TIMEOUT_S) -> str | None:
    """Why the mpi transport cannot run here, or None when it can: mpi4py must import and load its MPI
    library.

    ``hora check`` and ``hora run --mpi`` ask before any rank starts, so a missing mpi4py is one line
    from the launcher rather than the same traceback from every rank. The library is loaded in a child
    Python: importing ``mpi4py.MPI`` here would initialise MPI in the launcher itself, and a broken MPI
    install can abort the process that loads it. Whether the job is formed over MPI (mpirun,
    ``init(comm=...)``) is a fact about a job, not this machine, and is checked when one forms.
    """
    if "mpi4py.MPI" in sys.modules:
        return None  # this process has loaded it already
    try:
        import mpi4py  # the package alone is pure Python: importing it initialises nothing
    except ModuleNotFoundError as exc:
        if exc.name == "mpi4py":
            return f"mpi4py is not installed: {_INSTALL}"
        return f"mpi4py does not import ({exc}): {_REINSTALL}"
    except Exception as exc:  # whatever a broken install raises is the reason to show
        return f"mpi4py does not import ({exc}): {_REINSTALL}"
    # The child finds the same mpi4py even when this process found it through a sys.path entry of its own.
    where = [str(path) for path in getattr(mpi4py, "__path__", [])][:1]
    program = f"import sys, os; sys.path[:0] = [os.path.dirname(p) for p in {where!r}]; {_PROBE}"
    try:
        probe = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                               timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"loading mpi4py's MPI library did not finish within {timeout:.0f} s"
    except OSError as exc:
        return f"cannot start {sys.executable} to load mpi4py's MPI library: {exc}"
    if probe.returncode != 0:
        lines = [line.strip() for line in probe.stderr.splitlines() if line.strip()]
        cause = lines[-1] if lines else f"exit status {probe.returncode}"
        return (f"mpi4py cannot load an MPI library ({cause}): install Open MPI or MPICH "
                f"(apt-get install openmpi-bin), then {_REINSTALL}")
    return None


class MpiCommunicator(MemberCommunicator):
    """Collectives among ``members`` (hora world ranks) over an MPI communicator of their own."""

    name = "mpi"
    activity = "MPI"

    def __init__(self, rank: int, members: Sequence[int], store: RendezvousClient, scope: str,
                 secret: str | bytes, listen_host: str | None = None, **_: object) -> None:
        MPI = _mpi()
        self._MPI = MPI
        base = state.base_comm()
        if base is None:
            if not MPI.Is_initialized() or MPI.COMM_WORLD.Get_size() == 1 and len(members) > 1:
                raise TransportUnavailable("HORA_TRANSPORT=mpi needs a job started by mpirun (or hora run --mpi), "
                                           "or hora.init(comm=<mpi4py communicator>)")
            base = MPI.COMM_WORLD
        self._members = [int(m) for m in members]
        self._rank = rank
        if max(self._members) >= base.Get_size() or base.Get_rank() != self._members[rank]:
            raise TransportUnavailable(f"the mpi transport's ranks {self._members} are not ranks of the MPI "
                                       f"communicator (size {base.Get_size()}) this job was formed over")
        if self._members == list(range(base.Get_size())):
            comm = base.Dup()
        else:
            group = base.Get_group()
            sub = group.Incl(self._members)
            comm = base.Create_group(sub, tag=zlib.crc32(scope.encode()) % 32768)
            sub.Free()
            group.Free()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm = comm
        self.timeout = float(config.get("transport_timeout"))
        host = listen_host or config.get("iface") or route_address(store.host, store.port)
        self._lifelines: dict[int, socket.socket] = connect_mesh(
            rank, self._members, store, scope + "/lifeline", secret_bytes(secret), host,
            float(config.get("start_timeout")), 0)
        self._guard = CollectiveGuard(store, scope, self._members, rank, self.timeout, cut=self._cut)
        self._types: dict[int, Any] = {}
        self._ops: dict[tuple[np.dtype, ReduceOp], Any] = {}

    # ---- MPI plumbing ---------------------------------------------------------------------------

    def _etype(self, dtype: np.dtype) -> Any:
        """One element of ``dtype`` as an MPI datatype (contiguous bytes: MPI never splits one)."""
        size = np.dtype(dtype).itemsize
        etype = self._types.get(size)
        if etype is None:
            etype = self._MPI.BYTE.Create_contiguous(size).Commit()
            self._types[size] = etype
        return etype

    def _reduction(self, dtype: np.dtype, op: ReduceOp) -> tuple[Any, Any]:
        """(datatype, op) for reducing ``dtype`` with ``op``: MPI's own where defined, else NumPy."""
        MPI = self._MPI
        native = {np.dtype(np.int8): MPI.INT8_T, np.dtype(np.int16): MPI.INT16_T, np.dtype(np.int32): MPI.INT32_T,
                  np.dtype(np.int64): MPI.INT64_T, np.dtype(np.uint8): MPI.UINT8_T, np.dtype(np.uint16): MPI.UINT16_T,
                  np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}.get(dtype)
        mpi_op = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD,
                  ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR}[op]
        if native is not None:
            return native, mpi_op
        key = (dtype, op)
        user = self._ops.get(key)
        if user is None:
            func = reduction_ufunc(op, dtype)

            def combine(inbuf: Any, inoutbuf: Any, datatype: Any, dt: np.dtype = dtype, f: Any = func) -> None:
                a = np.frombuffer(inbuf, dtype=dt)
                b = np.frombuffer(inoutbuf, dtype=dt)
                with np.errstate(over="ignore", invalid="ignore"):
                    f(a, b, out=b)

            user = self._MPI.Op.Create(combine, commute=True)
            self._ops[key] = user
        return self._etype(dtype), user

    def _wait(self, request: Any, what: str) -> None:
        """Poll ``request`` to completion, watching the lifelines and the transport timeout."""
        for _ in range(_SPIN_TESTS):
            if request.Test():
                return
        lines = list(self._lifelines.items())
        socks = [s for _, s in lines]
        deadline = time.monotonic() + self.timeout
        while not request.Test():
            if socks:
                readable = select.select(socks, [], [], _POLL_S)[0]
            else:
                time.sleep(_POLL_S)
                readable = []
            for index, sock in lines:
                if sock not in readable:
                    continue
                if not _alive(sock):
                    raise PeerFailureError(f"rank {self._members[index]} died: its connection to rank "
                                           f"{self.global_rank} closed during {what}", self._members[index])
                # the peer closed its communicator cleanly (its part of this collective is done)
                self._lifelines.pop(index, None)
                lines = list(self._lifelines.items())
                socks = [s for _, s in lines]
            if time.monotonic() > deadline:
                raise PeerFailureError(f"no progress for {self.timeout:.0f} s in {what} over MPI", None,
                                       timed_out=True)

    def _run(self, what: str, start: Any) -> None:
        try:
            request = start()
        except self._MPI.Exception as exc:
            raise TransportError(f"rank {self.global_rank}: MPI refused {what}: {exc}") from None
        try:
            self._wait(request, what)
        except self._MPI.Exception as exc:
            raise PeerFailureError(f"rank {self.global_rank}: MPI failed {what}: {exc}") from None

    def _cut(self) -> None:
        for sock in self._lifelines.values():
            try:
                sock.close()
            except OSError:
                pass

    # ---- the collectives ------------------------------------------------------------------------

    def allreduce(self, buf: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> None:
        check_buffer(buf)
        check_op(op, buf.dtype)
        with self._guard("allreduce", buf.dtype):
            if self.size == 1 or buf.size == 0:
                return
            dtype, mpi_op = self._reduction(buf.dtype, op)
            self._run("allreduce", lambda: self._comm.Iallreduce(self._MPI.IN_PLACE, [buf, buf.size, dtype], mpi_op))

    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        check_buffer(send, "send")
        check_buffer(recv, "recv")
        counts = check_counts(counts, self.size, "counts")
        if send.dtype != recv.dtype:
            raise TypeError(f"allgather send dtype {send.dtype} != recv dtype {recv.dtype}")
        if send.size != counts[self.rank] or recv.size != sum(counts):
            raise ValueError(f"allgather: send has {send.size} elements (counts say {counts[self.rank]}), "
                             f"recv has {recv.size} (counts sum to {sum(counts)})")
        with self._guard("allgather"):
            etype = self._etype(send.dtype)
            displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(int).tolist()
            self._run("allgather", lambda: self._comm.Iallgatherv(
                [send, send.size, etype], [recv, (counts, displs), etype]))

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        check_buffer(buf)
        check_root(root, self.size)
        with self._guard("broadcast"):
            if self.size == 1 or buf.size == 0:
                return
            self._run("broadcast", lambda: self._comm.Ibcast([buf, buf.size, self._etype(buf.dtype)], root=root))

    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int]) -> None:
        check_buffer(send, "send")
        check_buffer(recv, "recv")
        send_counts = check_counts(send_counts, self.size, "send_counts")
        recv_counts = check_counts(recv_counts, self.size, "recv_counts")
        if send.dtype != recv.dtype:
            raise TypeError(f"alltoall send dtype {send.dtype} != recv dtype {recv.dtype}")
        if send.size != sum(send_counts) or recv.size != sum(recv_counts):
            raise ValueError(f"alltoall: send has {send.size} elements (counts sum to {sum(send_counts)}), "
                             f"recv has {recv.size} (counts sum to {sum(recv_counts)})")
        if send_counts[self.rank] != recv_counts[self.rank]:
            raise ValueError(f"alltoall: rank {self.global_rank} sends itself {send_counts[self.rank]} elements "
                             f"but expects {recv_counts[self.rank]} from itself")
        with self._guard("alltoall"):
            etype = self._etype(send.dtype)
            sd = np.concatenate([[0], np.cumsum(send_counts[:-1])]).astype(int).tolist()
            rd = np.concatenate([[0], np.cumsum(recv_counts[:-1])]).astype(int).tolist()
            self._run("alltoall", lambda: self._comm.Ialltoallv(
                [send, (send_counts, sd), etype], [recv, (recv_counts, rd), etype]))

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                      op: ReduceOp = ReduceOp.SUM) -> None:
        check_buffer(send, "send")
        check_buffer(recv, "recv")
        check_op(op, send.dtype)
        counts = check_counts(counts, self.size, "counts")
        if send.dtype != recv.dtype:
            raise TypeError(f"reducescatter send dtype {send.dtype} != recv dtype {recv.dtype}")
        if send.size != sum(counts) or recv.size != counts[self.rank]:
            raise ValueError(f"reducescatter: send has {send.size} elements (counts sum to {sum(counts)}), "
                             f"recv has {recv.size} (counts say {counts[self.rank]})")
        with self._guard("reducescatter", send.dtype):
            if sum(counts) == 0:
                return
            dtype, mpi_op = self._reduction(send.dtype, op)
            self._run("reducescatter", lambda: self._comm.Ireduce_scatter(
                [send, send.size, dtype], [recv, recv.size, dtype], counts, mpi_op))

    def barrier(self) -> None:
        with self._guard("barrier"):
            self._run("barrier", self._comm.Ibarrier)

    def _objects_to(self, payload: bytes, root: int | None) -> list[bytes] | None:
        """Every rank's ``payload`` at ``root`` (None: at every rank), through non-blocking calls."""
        mine = np.array([len(payload)], dtype=np.int64)
        lengths = np.zeros(self.size, dtype=np.int64)
        self._run("object sizes", lambda: self._comm.Iallgather([mine, 1, self._MPI.INT64_T],
                                                                  [lengths, 1, self._MPI.INT64_T]))
        counts = lengths.astype(int).tolist()
        displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(int).tolist()
        data = np.frombuffer(payload, dtype=np.uint8)
        out = np.empty(sum(counts), dtype=np.uint8)
        if root is None:
            self._run("object exchange", lambda: self._comm.Iallgatherv(
                [data, len(data), self._MPI.BYTE], [out, (counts, displs), self._MPI.BYTE]))
        else:
            self._run("object gather", lambda: self._comm.Igatherv(
                [data, len(data), self._MPI.BYTE], [out, (counts, displs), self._MPI.BYTE], root=root))
            if self.rank != root:
                return None
        return [out[d:d + c].tobytes() for d, c in zip(displs, counts)]

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        check_root(root, self.size)
        with self._guard("gather_object"):
            blobs = self._objects_to(pickle.dumps(obj), root)
        return None if blobs is None else [pickle.loads(b) for b in blobs]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        check_root(root, self.size)
        with self._guard("broadcast_object"):
            payload = pickle.dumps(obj) if self.rank == root else b""
            size = np.array([len(payload)], dtype=np.int64)
            self._run("object size", lambda: self._comm.Ibcast([size, 1, self._MPI.INT64_T], root=root))
            data = np.frombuffer(payload, dtype=np.uint8).copy() if self.rank == root \
                else np.empty(int(size[0]), dtype=np.uint8)
            self._run("object broadcast", lambda: self._comm.Ibcast([data, len(data), self._MPI.BYTE], root=root))
        return pickle.loads(data.tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        with self._guard("allgather_object"):
            blobs = self._objects_to(pickle.dumps(obj), None)
        assert blobs is not None
        return [pickle.loads(b) for b in blobs]

    def close(self) -> None:
        with self._guard.lock:
            if self._guard.closed:
                return
            self._guard.closed = True
            if self._guard.broken is None:
                for sock in self._lifelines.values():  # a goodbye, so peers tell a clean close from a death
                    try:
                        sock.send(_GOODBYE, socket.MSG_DONTWAIT)
                    except OSError:
                        pass
            self._cut()
            if self._guard.broken is None:
                try:
                    self._comm.Free()
                    for op in self._ops.values():
                        op.Free()
                    for etype in self._types.values():
                        etype.Free()
                except self._MPI.Exception:
                    pass


def _alive(sock: socket.socket) -> bool:
    """Whether a readable lifeline's peer is still there: only a goodbye byte is ever sent, so a
    readable lifeline either has it (a clean close) or is at end of file (the process is gone)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


# bfloat16 is an ml_dtypes type; make sure its NumPy ufuncs are registered before a user op runs.
_ = ml_dtypes.bfloat16
