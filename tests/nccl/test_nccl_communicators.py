"""Communicator bookkeeping per process set, the unique id travelling through a real authenticated rendezvous.

Four "ranks" are threads, each with its own authenticated RendezvousClient to a real RendezvousServer.
The unique id is NCCL's own (``ncclGetUniqueId`` needs no GPU) when libnccl is installed, else
random bytes; only ``ncclCommInitRank``, which needs a GPU, is recorded instead of called.
"""

from __future__ import annotations

import os
import threading

import pytest

from hora.errors import AuthenticationError, HoraError
from hora.nccl import library
from hora.nccl.communicators import CommunicatorTable
from hora.rendezvous.auth import new_secret
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.server import RendezvousServer

pytestmark = pytest.mark.timeout(120)


class InitRecorder:
    """NCCL's id and destroy calls as they are; ``comm_init_rank`` recorded (it needs a GPU)."""

    def __init__(self) -> None:
        self.inits: list[tuple[int, bytes, int]] = []
        self.destroyed: list[int] = []
        self._lock = threading.Lock()
        self._real = library.Nccl() if library.nccl_version() else None

    def unique_id(self) -> bytes:
        return self._real.unique_id() if self._real else os.urandom(library.UNIQUE_ID_BYTES)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        with self._lock:
            self.inits.append((nranks, unique_id, rank))
            return 0x1000 + len(self.inits)

    def comm_destroy(self, comm: int) -> None:
        self.destroyed.append(comm)


@pytest.fixture
def server():
    """A real rendezvous server; ``.secret`` is the job secret its clients authenticate with."""
    secret = new_secret()
    with RendezvousServer(secret) as srv:
        srv.secret = secret
        yield srv


def _ranks(server, members, key, nccl, scope="round0", timeout=20.0):
    results, errors = {}, {}

    def member(rank):
        try:
            with RendezvousClient(*server.address, server.secret, connect_timeout=10) as store:
                table = CommunicatorTable(nccl, store, scope, timeout=timeout)
                results[rank] = (table.get(key, members, rank), table)
        except Exception as exc:  # the test inspects it
            errors[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_every_member_gets_the_first_members_unique_id(server):
    nccl = InitRecorder()
    results, errors = _ranks(server, [0, 1, 2, 3], "global", nccl)
    assert not errors
    ids = {uid for _, uid, _ in nccl.inits}
    assert len(ids) == 1 and len(next(iter(ids))) == library.UNIQUE_ID_BYTES
    assert sorted(rank for _, _, rank in nccl.inits) == [0, 1, 2, 3]
    assert {comm.size for comm, _ in results.values()} == {4}


def test_each_process_set_gets_its_own_communicator_and_rank_numbering(server):
    nccl = InitRecorder()
    _, errors_a = _ranks(server, [1, 3], "set1", nccl)
    results_b, errors_b = _ranks(server, [0, 2, 3], "set2", nccl)
    assert not errors_a and not errors_b
    by_size: dict[int, set] = {}
    for nranks, uid, _ in nccl.inits:
        by_size.setdefault(nranks, set()).add(uid)
    assert set(by_size) == {2, 3} and by_size[2].isdisjoint(by_size[3])
    assert len(by_size[2]) == 1 and len(by_size[3]) == 1
    assert results_b[3][0].rank == 2 and results_b[0][0].rank == 0  # set rank, not global rank


def test_table_reuses_releases_and_renews_with_a_new_epoch(server):
    nccl = InitRecorder()
    with RendezvousClient(*server.address, server.secret, connect_timeout=10) as store:
        table = CommunicatorTable(nccl, store, "round0")
        first = table.get("solo", [5], 5)
        assert table.get("solo", [5], 5) is first and len(nccl.inits) == 1 and "solo" in table
        table.release("solo")
        assert nccl.destroyed == [first.comm] and "solo" not in table
        second = table.get("solo", [5], 5)
        assert second.epoch == 1 and len(nccl.inits) == 2
        assert table.key_for("solo", 1) in store.keys("hora/nccl/round0/")
        table.close()
        assert nccl.destroyed == [first.comm, second.comm] and len(table) == 0


def test_missing_first_member_fails_in_bounded_time_naming_rank_and_set(server):
    nccl = InitRecorder()
    with RendezvousClient(*server.address, server.secret, connect_timeout=10) as store:
        table = CommunicatorTable(nccl, store, "round0", timeout=1.0)
        with pytest.raises(HoraError, match=r"rank 2: no NCCL unique id for process set lonely from its first "
                                            r"member \(rank 0\)"):
            table.get("lonely", [0, 2], 2)
        with pytest.raises(HoraError, match="rank 9 is not in process set"):
            table.get("other", [0, 2], 9)


def test_a_stranger_without_the_job_secret_cannot_read_the_id(server):
    with pytest.raises(AuthenticationError):
        RendezvousClient(*server.address, new_secret(), connect_timeout=5)


class SharedGpu(InitRecorder):
    """What real NCCL answers when two ranks of one communicator sit on the same GPU (as seen on an
    H100 with two ranks: ``ncclCommInitRank failed: invalid usage``)."""

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        raise library.NcclError("ncclCommInitRank failed: invalid usage (run with NCCL_DEBUG=WARN for details) "
                                "(ncclResult_t 5)", library.INVALID_USAGE)


def test_two_ranks_on_one_gpu_are_told_the_cause_and_the_ways_out(server):
    with RendezvousClient(*server.address, server.secret, connect_timeout=10) as store:
        table = CommunicatorTable(SharedGpu(), store, "round0")
        with pytest.raises(library.NcclError) as failure:
            table.get(0, [0], 0)
    text = str(failure.value)
    assert text.startswith("rank 0 on ") and "process set 0" in text and "invalid usage" in text
    assert "two ranks of the set on one GPU" in text and "HORA_NCCL=off" in text
    assert failure.value.result == library.INVALID_USAGE and len(table) == 0
