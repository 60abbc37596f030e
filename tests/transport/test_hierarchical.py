"""Hierarchical allreduce as world formation builds it, on hosts emulated by host labels.

Every rank of a job runs on this one machine; each is given a host label (``connect_world(machine=)``),
and ranks with the same label form one emulated host. World size 3 or 4, with as many ranks on one
host as on another (2+2) or not (2+1, 1+2, 3+1): with ``HORA_HIERARCHICAL_ALLREDUCE=1`` every
allreduce must give every rank the exact sums, on the small-message and the pipelined paths.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora
from hora.transport import ReduceOp

COUNTS = (1, 7, 1001, 300_001)  # up to 1.2 MB of float32: past the small-message threshold


def host_labels(layout: tuple[int, ...]) -> list[str]:
    """One label per rank: ``layout[i]`` consecutive ranks on emulated host i."""
    return [f"emulated-host-{i}" for i, n in enumerate(layout) for _ in range(n)]


def _hierarchical_worker(layout: tuple[int, ...]) -> dict[str, Any]:
    from hora import config
    from hora.runtime import connect_world

    rank = config.get("rank")
    comm = connect_world(machine=host_labels(layout)[rank])
    try:
        report: dict[str, Any] = {"kind": type(comm).__name__, "errors": []}
        for count in COUNTS:
            for dtype, op in ((np.float32, ReduceOp.SUM), (np.int64, ReduceOp.SUM), (np.float64, ReduceOp.MAX)):
                base = np.arange(count, dtype=np.int64) % 97
                buf = (base + rank).astype(dtype)
                try:
                    comm.allreduce(buf, op)
                except Exception as exc:  # reported to the test
                    report["errors"].append(f"{count} x {np.dtype(dtype).name} {op.name}: {type(exc).__name__}: {exc}")
                    return report
                if op == ReduceOp.SUM:
                    expected = (base * comm.size + sum(range(comm.size))).astype(dtype)
                else:
                    expected = (base + comm.size - 1).astype(dtype)
                bad = np.flatnonzero(buf != expected)
                if bad.size:
                    k = int(bad[0])
                    report["errors"].append(
                        f"{count} x {np.dtype(dtype).name} {op.name}: {bad.size} wrong elements, first at {k}: "
                        f"{buf[k]!r} instead of {expected[k]!r}")
        return report
    finally:
        comm.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [(2, 1), (1, 2), (3, 1), (2, 2), (3, 2)],
                         ids=lambda layout: "+".join(map(str, layout)))
def test_hierarchical_allreduce_sums_exactly_on_even_and_uneven_hosts(layout: tuple[int, ...]) -> None:
    env = {"HORA_HIERARCHICAL_ALLREDUCE": "1", "HORA_TRANSPORT_TIMEOUT": "15"}
    results = hora.run(_hierarchical_worker, args=(layout,), np=sum(layout), env=env)
    for rank, report in enumerate(results):
        assert report["kind"] == "HierarchicalCommunicator", report
        assert not report["errors"], f"rank {rank} on hosts {layout}: {report['errors']}"


def _kind_worker(layout: tuple[int, ...]) -> str:
    from hora import config
    from hora.runtime import connect_world

    comm = connect_world(machine=host_labels(layout)[config.get("rank")])
    try:
        return type(comm).__name__
    finally:
        comm.close()


@pytest.mark.timeout(120)
def test_uneven_hosts_use_the_flat_ring_unless_hierarchical_allreduce_is_asked_for() -> None:
    assert hora.run(_kind_worker, args=((2, 1),), np=3) == ["TcpCommunicator"] * 3
