"""Failures a transport must survive: a peer that dies, a peer that hangs, a stranger that knocks.

World size 3 everywhere (so a failure has a neighbour that sees it directly and one that does not).
The jobs are launched with :func:`hora.run`, which ends a job as soon as one worker process fails.
To observe what the *surviving* ranks see, the dying rank runs its communicator in a forked child:
that child owns rank 2's connections and dies abruptly (``os._exit`` or SIGKILL), while the worker
process itself waits for it and returns normally. Every rank's observations come back as ordinary
return values of ``hora.run``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from typing import Any

import numpy as np
import pytest

import hora
from hora import config
from hora.errors import AuthenticationError, HorovodInternalError, PeerFailureError
from hora.transport import ReduceOp

WORLD_SIZE = 3
DETECT_LIMIT_S = 10.0
PAYLOADS = {"small": 16, "ring": 512 * 1024}  # float32 elements: direct path, pipelined ring path
SURVIVOR_DEADLINE_S = 60.0


def _store():
    from hora.rendezvous import RendezvousClient

    return RendezvousClient(config.get("rendezvous_addr"), config.get("rendezvous_port"), config.get("secret"))


def _allreduce_until_failure(comm, count: int, deadline_s: float) -> dict[str, Any]:
    """Allreduce in a loop until the transport raises; what was raised, and how quickly."""
    buf = np.ones(count, dtype=np.float32)
    iterations = 0
    last_ok = time.monotonic()
    stop_at = last_ok + deadline_s
    while time.monotonic() < stop_at:
        try:
            buf[...] = 1
            comm.allreduce(buf, ReduceOp.SUM)
        except Exception as exc:  # reported to the test
            return {
                "raised": True,
                "type": type(exc).__name__,
                "is_peer_failure": isinstance(exc, PeerFailureError),
                "is_internal": isinstance(exc, HorovodInternalError),
                "message": str(exc),
                "failed_rank": getattr(exc, "failed_rank", None),
                "seconds_since_last_ok": time.monotonic() - last_ok,
                "iterations": iterations,
            }
        if float(buf[0]) != comm.size:
            return {"raised": False, "message": f"wrong sum {float(buf[0])} at iteration {iterations}"}
        iterations += 1
        last_ok = time.monotonic()
    return {"raised": False, "message": f"no error after {iterations} allreduces in {deadline_s:.0f} s"}


def _dying_rank_worker(victim: int, how: str, count: int, iterations_before_death: int,
                       transport: str = "tcp") -> dict[str, Any]:
    from hora.runtime import connect_world

    rank = config.get("rank")
    if rank != victim:
        comm = connect_world(transport)
        try:
            return {"rank": rank, **_allreduce_until_failure(comm, count, SURVIVOR_DEADLINE_S)}
        finally:
            comm.close()
    pid = os.fork()
    if pid == 0:  # the child owns the victim's connections and dies in the middle of the loop
        code = 3
        try:
            comm = connect_world(transport)
            buf = np.ones(count, dtype=np.float32)
            for _ in range(iterations_before_death):
                comm.allreduce(buf)
                buf[...] = 1
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {"rank": rank, "child_status": os.waitstatus_to_exitcode(status)}


def _names_rank(message: str, rank: int) -> bool:
    return re.search(rf"\brank {rank}\b", message) is not None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_dead_peer_fails_every_other_rank(how: str, payload: str, transport: str) -> None:
    """World size 3: rank 2 dies mid-loop; ranks 0 and 1 raise PeerFailureError naming rank 2."""
    victim = 2
    results = hora.run(
        _dying_rank_worker, args=(victim, how, PAYLOADS[payload], 20, transport), np=WORLD_SIZE,
        env={"HORA_TRANSPORT_TIMEOUT": "30"},
    )
    expected_status = -signal.SIGKILL if how == "sigkill" else 1
    assert results[victim]["child_status"] == expected_status, results[victim]
    for report in results:
        if report["rank"] == victim:
            continue
        assert report["raised"], f"rank {report['rank']}: {report['message']}"
        assert report["is_peer_failure"] and report["is_internal"], report
        assert _names_rank(report["message"], victim), f"rank {report['rank']} does not name rank {victim}: {report}"
        assert report["failed_rank"] == victim, report
        assert report["seconds_since_last_ok"] < DETECT_LIMIT_S, report


def _hung_rank_worker(hung: int, count: int, timeout_s: float, transport: str = "tcp") -> dict[str, Any]:
    from hora.runtime import connect_world

    rank = config.get("rank")
    comm = connect_world(transport)
    store = _store()
    try:
        comm.barrier()
        if rank == hung:
            # "Hangs": never calls the collective, until every other rank has reported.
            others = [f"hung-test/done/{r}" for r in range(comm.size) if r != hung]
            missing = store.wait(others, timeout=SURVIVOR_DEADLINE_S)
            return {"rank": rank, "missing": missing}
        started = time.monotonic()
        report = _allreduce_until_failure(comm, count, deadline_s=timeout_s * 10)
        report["seconds_in_collective"] = time.monotonic() - started
        store.set(f"hung-test/done/{rank}", b"1")
        return {"rank": rank, **report}
    finally:
        comm.close()
        store.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("payload", ["small", "ring"])
def test_hung_peer_times_out_naming_it(payload: str, transport: str) -> None:
    """World size 3, HORA_TRANSPORT_TIMEOUT=2: rank 1 never enters; rank 0 raises after the timeout
    (plus the time ranks take to agree on whom to blame), naming it."""
    hung, timeout_s = 1, 2.0
    results = hora.run(
        _hung_rank_worker, args=(hung, PAYLOADS[payload], timeout_s, transport), np=WORLD_SIZE,
        env={"HORA_TRANSPORT_TIMEOUT": str(timeout_s)},
    )
    assert results[hung]["missing"] == [], results[hung]
    for report in results:
        if report["rank"] == hung:
            continue
        assert report["raised"], f"rank {report['rank']}: {report['message']}"
        assert report["is_peer_failure"], report
        assert report["iterations"] == 0, report
        if report["rank"] == 0:
            assert _names_rank(report["message"], hung), f"rank 0 does not name rank {hung}: {report}"
            assert report["failed_rank"] == hung, report
            assert timeout_s * 0.9 <= report["seconds_in_collective"] <= timeout_s * 10, report


def _stranger_worker(knocker: int, count: int) -> dict[str, Any]:
    """Rank ``knocker`` probes the others' listening ports and the store before joining the job."""
    from hora.rendezvous import RendezvousClient, new_secret
    from hora.rendezvous.auth import authenticate_as_client, secret_bytes
    from hora.runtime import connect_world

    rank = config.get("rank")
    report: dict[str, Any] = {"rank": rank}
    if rank == knocker:
        store = _store()
        try:
            addresses = _wait_for_listeners(store, expected=knocker)
        finally:
            store.close()
        report["probed"] = sorted(addresses)
        outcomes = []
        endpoints = []
        for key, text in sorted(addresses.items()):
            address = json.loads(text)
            host, port = address["tcp"].rsplit(":", 1)
            endpoints.append((f"{key} tcp", socket.AF_INET, (host, int(port))))
            if address.get("unix"):
                endpoints.append((f"{key} unix", socket.AF_UNIX, "\0" + address["unix"]))
        # A stranger that connects and never speaks must delay nobody.
        silent = []
        for _, family, target in endpoints:
            lurker = socket.socket(family, socket.SOCK_STREAM)
            lurker.connect(target)
            silent.append(lurker)
        report["silent_connections"] = len(silent)
        for key, family, target in endpoints:
            # 1. a handshake with the wrong secret
            with _connected(family, target) as sock:
                try:
                    authenticate_as_client(sock, secret_bytes(new_secret()), timeout=10)
                    outcomes.append(f"{key}: wrong secret ACCEPTED")
                except AuthenticationError:
                    outcomes.append(f"{key}: wrong secret refused")
            # 2. plain garbage
            with _connected(family, target) as sock:
                sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 4)
                sock.settimeout(10)
                try:
                    while sock.recv(4096):
                        pass
                    outcomes.append(f"{key}: garbage dropped")
                except OSError:
                    outcomes.append(f"{key}: garbage dropped")
        # 3. the rendezvous store: garbage, then the wrong secret
        with socket.create_connection((config.get("rendezvous_addr"), config.get("rendezvous_port")),
                                      timeout=10) as sock:
            sock.sendall(b"\x00\x00\x00\x10" + b"x" * 200)
            sock.settimeout(10)
            try:
                while sock.recv(4096):
                    pass
            except OSError:
                pass
        try:
            RendezvousClient(config.get("rendezvous_addr"), config.get("rendezvous_port"), new_secret(),
                             connect_timeout=5).close()
            outcomes.append("store: wrong secret ACCEPTED")
        except AuthenticationError:
            outcomes.append("store: wrong secret refused")
        report["outcomes"] = outcomes
    comm = connect_world("tcp")
    try:
        buf = np.arange(count, dtype=np.float32) * (rank + 1)
        comm.allreduce(buf)
        expected = np.arange(count, dtype=np.float32) * sum(range(1, comm.size + 1))
        report["allreduce_ok"] = bool(np.array_equal(buf, expected))
        report["gathered"] = comm.allgather_object(rank)
    finally:
        comm.close()
    return report


def _connected(family: int, target: Any) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(target)
    return sock


def _wait_for_listeners(store, expected: int, timeout: float = 30.0) -> dict[str, str]:
    """The published peer addresses of the ranks below ``expected`` (they listen for it)."""
    deadline = time.monotonic() + timeout
    while True:
        addresses = {key: store.try_get(key).decode() for key in store.keys() if "/addr/" in key}
        if len(addresses) >= expected or time.monotonic() > deadline:
            return addresses
        time.sleep(0.02)


@pytest.mark.timeout(90)
def test_strangers_are_refused_and_the_job_completes() -> None:
    """World size 3: wrong-secret and garbage connections to the peers' listening ports and to the
    rendezvous store are refused, silent connections delay nobody, and the job still forms and
    computes correctly."""
    knocker = WORLD_SIZE - 1
    results = hora.run(_stranger_worker, args=(knocker, 100_000), np=WORLD_SIZE)
    report = results[knocker]
    assert len(report["probed"]) == knocker, report
    assert not any("ACCEPTED" in line for line in report["outcomes"]), report["outcomes"]
    # Every endpoint (TCP, and Unix-domain for same-host peers) refused, and the rendezvous store too.
    endpoints = report["silent_connections"]
    assert endpoints >= knocker, report
    assert sum("refused" in line for line in report["outcomes"]) == endpoints + 1, report["outcomes"]
    for r in results:
        assert r["allreduce_ok"], r
        assert r["gathered"] == list(range(WORLD_SIZE)), r
