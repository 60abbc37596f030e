"""The engine's device path end to end on 2 real worker processes, NCCL and CUDA emulated in host memory.

Each rank installs the emulation (``nccl_emulation.install``) before ``hora.init``, then calls hora's
generic API on "CUDA" arrays (``__cuda_array_interface__``, as CuPy presents them): the signatures
carry ``device="cuda"``, the coordinator negotiates them like any other, the executor hands them to
the device context, which makes its communicators through the job's rendezvous and runs the
collectives through :class:`hora.nccl.ops.DeviceCollectives`. Every result is checked against NumPy;
host arrays in flight at the same time keep the CPU transports. The negotiation rules for the path
(ranks that chose differently, join) are checked on the coordinator directly.
"""

from __future__ import annotations

import numpy as np
import pytest
from job_env import clean_env

import hora
from hora.engine.coordinator import Coordinator
from hora.engine.request import Kind, signature
from hora.transport.base import ReduceOp

pytestmark = pytest.mark.timeout(180)


def _base(rank: int, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    """Small integers (exact in float32 after averaging over 2 ranks) that differ by rank and salt."""
    count = int(np.prod(shape)) if shape else 1
    return ((np.arange(count) * 3 + rank * 5 + salt) % 11 - 5).astype(np.float32).reshape(shape)


def _job() -> dict:
    import sys

    sys.path.insert(0, __import__("os").path.dirname(__file__))
    import nccl_emulation
    from nccl_emulation import HostCudaArray

    cuda, nccl = nccl_emulation.install()
    hora.init()
    r = hora.rank()
    out: dict = {"calls_before": list(nccl.calls)}
    arr = HostCudaArray(_base(r, (4, 3)))
    before = arr.host.copy()
    avg = hora.allreduce(arr, name="avg")
    out["avg_type"] = type(avg).__name__
    out["avg"] = avg.host.tolist()
    out["input_kept"] = bool(np.array_equal(arr.host, before))
    inplace = HostCudaArray(_base(r, (5,), 1))
    same = hora.allreduce_(inplace, op=hora.Sum, name="sum_")
    out["inplace_same_object"] = same is inplace
    out["sum_"] = inplace.host.tolist()
    group = [HostCudaArray(_base(r, (n,), n)) for n in (3, 6, 2)]
    out["grouped"] = [g.host.tolist() for g in hora.grouped_allreduce(group, op=hora.Sum, name="grp")]
    out["scaled"] = hora.allreduce(HostCudaArray(_base(r, (4,), 2)), op=hora.Sum, prescale_factor=2.0,
                                   postscale_factor=1.5, name="scaled").host.tolist()
    out["min"] = hora.allreduce(HostCudaArray(_base(r, (6,), 3)), op=hora.Min, name="min").host.tolist()
    rows = HostCudaArray(_base(r, (2 + r, 3), 4))
    out["allgather"] = hora.allgather(rows, name="ag").host.tolist()
    out["broadcast"] = hora.broadcast(HostCudaArray(_base(r, (3, 2), 5)), root_rank=1, name="bc").host.tolist()
    target = HostCudaArray(_base(r, (4,), 6))
    hora.broadcast_(target, root_rank=0, name="bc_")
    out["broadcast_"] = target.host.tolist()
    splits = [1, 2] if r == 0 else [3, 1]
    received, recv_splits = hora.alltoall(HostCudaArray(_base(r, (3 if r == 0 else 4, 2), 7)), splits=splits,
                                          name="a2a")
    out["alltoall"] = (received.host.tolist(), np.asarray(recv_splits).tolist())
    out["reducescatter"] = hora.reducescatter(HostCudaArray(_base(r, (5, 2), 8)), op=hora.Average,
                                              name="rs").host.tolist()
    out["reducescatter_blocks"] = hora.reducescatter(HostCudaArray(_base(r, (5, 2), 8)), op=hora.Average,
                                                     name="rs.blocks", blocks=[1, 4]).host.tolist()
    # a host array and a device array in flight together: each takes its own path
    host_handle = hora.allreduce_async(_base(r, (7,), 9), op=hora.Sum, name="mixed.host")
    dev_handle = hora.allreduce_async(HostCudaArray(_base(r, (7,), 9)), op=hora.Sum, name="mixed.dev")
    out["mixed_host"] = hora.synchronize(host_handle).tolist()
    out["mixed_dev"] = hora.synchronize(dev_handle).host.tolist()
    # the same names again: served by the response cache, still on the device
    for step in range(3):
        again = hora.allreduce(HostCudaArray(_base(r, (4, 3), step)), name="avg")
        out.setdefault("repeat", []).append(again.host.tolist())
    # a long training: CUDA events are reused, not created anew (and never destroyed) at every step
    events_before = len(cuda._events)
    for step in range(20):
        hora.allreduce(HostCudaArray(_base(r, (4, 3), step)), name="avg")
    out["new_events_in_20_steps"] = len(cuda._events) - events_before
    # a process set gets its own communicator (one set per rank here: each of size 1)
    sets = [hora.add_process_set([0]), hora.add_process_set([1])]
    out["process_set"] = hora.allreduce(HostCudaArray(_base(r, (3,), 10)), op=hora.Sum, name="ps",
                                        process_set=sets[r]).host.tolist()
    for ps in sets:
        hora.remove_process_set(ps)
    out["destroys_after_remove"] = nccl.calls.count("destroy")
    # integers cannot be averaged inside NCCL: the generic API names why
    try:
        hora.allreduce(HostCudaArray(np.arange(4, dtype=np.int32)), name="int_avg")
        out["int_error"] = ""
    except TypeError as exc:
        out["int_error"] = str(exc)
    out["inits"] = [c for c in nccl.calls if c.startswith("init")]
    out["devices_set"] = sorted(set(cuda.devices_set))
    hora.shutdown()
    out["destroys_after_shutdown"] = nccl.calls.count("destroy")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return hora.run(_job, np=2, env=clean_env(), start_timeout=60)


def _expected(shape, salt, op="sum", scale=1.0):
    parts = [_base(r, shape, salt) for r in range(2)]
    if op == "min":
        return np.minimum(*parts).tolist()
    total = (parts[0] * np.float32(scale)) + (parts[1] * np.float32(scale))
    return (total if op == "sum" else total / 2).tolist()


def test_steps_reuse_cuda_events(results):
    for out in results:
        assert out["new_events_in_20_steps"] <= 2, out["new_events_in_20_steps"]


def test_cpu_job_touches_no_nccl_until_a_cuda_array_arrives(results):
    for out in results:
        assert out["calls_before"] == []
        assert out["devices_set"] == [0]


def test_allreduce_forms_on_the_device_path_match_numpy(results):
    for out in results:
        assert out["avg_type"] == "HostCudaArray"
        assert out["avg"] == _expected((4, 3), 0, "avg")
        assert out["input_kept"]
        assert out["inplace_same_object"]
        assert out["sum_"] == _expected((5,), 1)
        assert out["grouped"] == [_expected((n,), n) for n in (3, 6, 2)]
        assert out["scaled"] == _expected((4,), 2, "sum", scale=3.0)  # 2.0 before, 1.5 after: one PreMulSum of 3
        assert out["min"] == _expected((6,), 3, "min")
        assert out["repeat"] == [_expected((4, 3), step, "avg") for step in range(3)]


def test_gather_broadcast_alltoall_reducescatter_on_the_device_path(results):
    gathered = np.concatenate([_base(r, (2 + r, 3), 4) for r in range(2)]).tolist()
    chunks = [np.split(_base(0, (3, 2), 7), [1]), np.split(_base(1, (4, 2), 7), [3])]
    reduced = (_base(0, (5, 2), 8) + _base(1, (5, 2), 8)) / 2
    for rank, out in enumerate(results):
        assert out["allgather"] == gathered
        assert out["broadcast"] == _base(1, (3, 2), 5).tolist()
        assert out["broadcast_"] == _base(0, (4,), 6).tolist()
        received, recv_splits = out["alltoall"]
        assert received == np.concatenate([chunks[0][rank], chunks[1][rank]]).tolist()
        assert recv_splits == ([1, 3] if rank == 0 else [2, 1])
        assert out["reducescatter"] == (reduced[:3] if rank == 0 else reduced[3:]).tolist()
        assert out["reducescatter_blocks"] == (reduced[:1] if rank == 0 else reduced[1:]).tolist()


def test_host_and_device_tensors_mix_in_one_job(results):
    for out in results:
        assert out["mixed_host"] == out["mixed_dev"] == _expected((7,), 9)


def test_communicators_per_process_set_and_destroyed_at_shutdown(results):
    for rank, out in enumerate(results):
        assert out["inits"] == [f"init:{rank}/2", "init:0/1"]  # the world, then its own process set
        assert out["process_set"] == _base(rank, (3,), 10).tolist()
        assert out["destroys_after_remove"] == 1  # the removed set's communicator
        assert out["destroys_after_shutdown"] == 2  # and the world's


def test_integer_average_is_refused_with_the_reason(results):
    for rank, out in enumerate(results):
        assert f"rank {rank}" in out["int_error"] and "integers" in out["int_error"]


def test_ranks_on_different_paths_fail_negotiation_naming_both():
    coordinator = Coordinator([0, 1])
    dev = signature(Kind.ALLREDUCE, "float32", (4,), ReduceOp.SUM, device="cuda")
    host = signature(Kind.ALLREDUCE, "float32", (4,), ReduceOp.SUM)
    coordinator.submit(0, [("g", dev)])
    coordinator.submit(1, [("g", host)])
    [response] = coordinator.ready()
    assert "paths" in response.error and "rank 0 has NCCL on the device" in response.error
    assert "rank 1 has host memory" in response.error


def test_join_with_a_device_allreduce_is_refused_with_a_way_out():
    coordinator = Coordinator([0, 1])
    coordinator.submit(1, [("join", signature(Kind.JOIN, "uint8", ()))])
    coordinator.submit(0, [("g", signature(Kind.ALLREDUCE, "float32", (4,), ReduceOp.SUM, device="cuda"))])
    responses = {r.name: r for r in coordinator.ready()}
    assert "HORA_NCCL=off" in responses["g"].error


def test_a_failed_job_aborts_its_communicators_instead_of_waiting_on_them():
    from hora.nccl.communicators import CommunicatorTable
    from hora.rendezvous.auth import new_secret
    from hora.rendezvous.client import RendezvousClient
    from hora.rendezvous.server import RendezvousServer

    class Backend:
        def __init__(self):
            self.calls = []

        def unique_id(self):
            return b"u" * 128

        def comm_init_rank(self, nranks, unique_id, rank):
            return 1 + len(self.calls)

        def comm_destroy(self, comm):
            self.calls.append(("destroy", comm))

        def comm_abort(self, comm):
            self.calls.append(("abort", comm))

    secret = new_secret()
    with RendezvousServer(secret) as server, RendezvousClient(*server.address, secret) as store:
        backend = Backend()
        table = CommunicatorTable(backend, store, "round0", timeout=5)
        table.get(0, [0], 0)
        table.get(1, [0], 0)
        table.release(1)
        table.close(abort=True)
        assert backend.calls == [("destroy", 1), ("abort", 1)]
        assert len(table) == 0
