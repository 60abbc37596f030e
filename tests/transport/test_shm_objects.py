"""Shared memory's object collectives: small objects travel through the small-message slots (one
synchronisation, no TCP), objects that do not fit go over the TCP mesh, and every rank takes the same
path even when only one rank's object is too large. Interleaved with small allreduces, which use the
same alternating slots. An object that cannot be pickled fails the call on every rank."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import numpy as np
import pytest

import hora


def _sized(nbytes: int, fill: int) -> bytes:
    """A bytes object whose pickle is exactly ``nbytes`` long."""
    overhead = len(pickle.dumps(b"x" * nbytes, protocol=pickle.HIGHEST_PROTOCOL)) - nbytes
    for extra in range(-4, 5):  # the length prefix may change size at the boundary
        payload = bytes([fill]) * (nbytes - overhead + extra)
        if len(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)) == nbytes:
            return payload
    raise AssertionError(f"no payload pickles to {nbytes} bytes")


def _worker() -> list[str]:
    from hora.runtime import connect_world
    from hora.transport import shm
    from hora.transport.base import ReduceOp

    comm = connect_world("shm")
    assert isinstance(comm, shm.ShmCommunicator)
    n, me = comm.size, comm.rank
    mesh_calls: list[str] = []
    for name in ("gather_object", "allgather_object", "broadcast_object"):
        real = getattr(comm._mesh, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            mesh_calls.append(_name)
            return _real(*args)
        setattr(comm._mesh, name, counted)
    bad: list[str] = []

    def check(label: str, got: Any, want: Any) -> None:
        if got != want:
            bad.append(f"rank {me}: {label}: got {str(got)[:80]!r}, want {str(want)[:80]!r}")

    def via_mesh(label: str, expected: bool) -> None:
        used = bool(mesh_calls)
        mesh_calls.clear()
        if used != expected:
            bad.append(f"rank {me}: {label}: {'went' if used else 'did not go'} over the mesh")

    try:
        # Interleaved with small allreduces on the same slots, many rounds, every root.
        for step in range(40):
            root = step % n
            obj = {"step": step, "rank": me, "array": np.arange(step + me), "text": "é" * me}
            got = comm.gather_object(obj, root)
            if me == root:
                check(f"gather step {step}", [(o["step"], o["rank"], o["array"].tolist()) for o in got],
                      [(step, m, list(range(step + m))) for m in range(n)])
            else:
                check(f"gather step {step} (non-root)", got, None)
            x = np.full(3, float(me + step), dtype=np.float64)
            comm.allreduce(x, ReduceOp.SUM)
            check(f"allreduce step {step}", x.tolist(), [float(sum(range(n)) + n * step)] * 3)
            check(f"broadcast step {step}", comm.broadcast_object((step, me), root), (step, root))
            check(f"allgather step {step}", comm.allgather_object(me * step), [m * step for m in range(n)])
        via_mesh("small objects", False)

        # Exactly a slot's room fits; one byte more goes over the mesh (on every rank, for gather and
        # allgather even though only rank 1's object is too large).
        room = shm._OBJECT_ROOM
        for size, over in ((room, False), (room + 1, True)):
            mine = _sized(size, me) if me == 1 else me
            want = [_sized(size, 1) if m == 1 else m for m in range(n)]
            got = comm.gather_object(mine, n - 1)
            check(f"gather of {size} B", got, want if me == n - 1 else None)
            via_mesh(f"gather of {size} B", over)
            check(f"allgather of {size} B", comm.allgather_object(mine), want)
            via_mesh(f"allgather of {size} B", over)
            check(f"broadcast of {size} B", comm.broadcast_object(mine, 1), want[1])
            via_mesh(f"broadcast of {size} B", over)
        # After the mesh, the slots again.
        check("allgather after the mesh", comm.allgather_object(me), list(range(n)))
        via_mesh("allgather after the mesh", False)

        # A rank whose object cannot be pickled: the call fails on every rank, the others naming it
        # (never a stale object from the slot), and the communicator goes on.
        for label, call, culprit in (("gather", lambda o: comm.gather_object(o, 0), 1),
                                     ("allgather", comm.allgather_object, 1),
                                     ("broadcast", lambda o: comm.broadcast_object(o, n - 1), n - 1)):
            obj = threading.Lock() if me == culprit else ("fine", me)
            try:
                got = call(obj)
                bad.append(f"rank {me}: {label} of an unpicklable object returned {got!r}")
            except TypeError as exc:
                if me != culprit or "pickle" not in str(exc):
                    bad.append(f"rank {me}: {label}: {exc!r}")
            except ValueError as exc:
                if me == culprit or f"rank {culprit} could not pickle its object" not in str(exc):
                    bad.append(f"rank {me}: {label}: {exc!r}")
            check(f"allgather after the failed {label}", comm.allgather_object(me), list(range(n)))
        via_mesh("unpicklable objects", False)
    finally:
        comm.close()
    return bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [2, 3])
def test_shm_object_collectives_use_the_slots_and_agree_on_the_fallback(ranks: int) -> None:
    assert hora.run(_worker, np=ranks) == [[]] * ranks
