"""World formation's transport choice, for a whole job and for a group of its ranks (a process set).

World size 3 on this one machine; hosts are emulated by host labels (ranks with the same label
count as one host). A group gets the transport a world of its ranks would: shared memory when its
ranks share a host, hierarchical allreduce across hosts when asked for (hosts of unequal size
included), TCP when ``HORA_TRANSPORT=tcp``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora

LABELS = ("host-a", "host-a", "host-b")  # 2 + 1 ranks


def _group_worker(groups: list[list[int]]) -> list[dict[str, Any]]:
    from hora import config
    from hora.rendezvous import RendezvousClient
    from hora.transport.topology import Topology
    from hora.transport.world import connect_group

    rank = config.get("rank")
    store = RendezvousClient(config.get("rendezvous_addr"), config.get("rendezvous_port"), config.get("secret"))
    reports = []
    try:
        for n, members in enumerate(groups):
            if rank not in members:
                reports.append({})
                continue
            topology = Topology(tuple(LABELS[m] for m in members))
            comm = connect_group(members.index(rank), members, store, f"group-test/{n}", config.get("secret"), topology)
            try:
                buf = np.full(1001, rank + 1, dtype=np.float32)
                comm.allreduce(buf)
                reports.append({"kind": type(comm).__name__, "sum": float(buf[0]),
                                "uniform": bool((buf == buf[0]).all())})
            finally:
                comm.close()
    finally:
        store.close()
    return reports


GROUPS = [[0, 1], [0, 1, 2], [1, 2]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("env", "kinds"),
    [
        ({}, ["ShmCommunicator", "TcpCommunicator", "TcpCommunicator"]),
        ({"HORA_HIERARCHICAL_ALLREDUCE": "1"},
         ["ShmCommunicator", "HierarchicalCommunicator", "HierarchicalCommunicator"]),
        ({"HORA_TRANSPORT": "tcp"}, ["TcpCommunicator"] * 3),
    ],
    ids=["auto", "hierarchical", "tcp"],
)
def test_a_group_of_ranks_gets_the_transport_a_world_of_them_would(env: dict[str, str], kinds: list[str]) -> None:
    results = hora.run(_group_worker, args=(GROUPS,), np=len(LABELS), env=env)
    for n, members in enumerate(GROUPS):
        expected_sum = float(sum(m + 1 for m in members))
        for rank in members:
            report = results[rank][n]
            assert report["kind"] == kinds[n], (members, rank, report)
            assert report["sum"] == expected_sum and report["uniform"], (members, rank, report)
