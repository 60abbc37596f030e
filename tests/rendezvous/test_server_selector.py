"""The rendezvous server's one selector thread: many clients, parked waits, misbehaving peers, stop().

Real server, real clients and raw sockets that speak the wire format by hand where a test needs a
client to misbehave.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import pytest

import hora.rendezvous.server as server_module
from hora.errors import AuthenticationError, RendezvousError
from hora.rendezvous.auth import authenticate_as_client, new_secret, secret_bytes
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.rounds import StaleRoundError, round_prefix
from hora.rendezvous.server import MAX_WAIT_SLICE, RendezvousServer
from hora.rendezvous.wire import recv_frame, send_frame

pytestmark = pytest.mark.timeout(60)


def _started() -> RendezvousServer:
    """A running server that remembers its secret (for the tests' clients)."""
    secret = new_secret()
    srv = RendezvousServer(secret).start()
    srv.secret = secret
    return srv


@pytest.fixture
def server():
    srv = _started()
    try:
        yield srv
    finally:
        srv.stop()


def _client(server) -> RendezvousClient:
    return RendezvousClient(*server.address, server.secret, connect_timeout=20)


def _raw(server) -> socket.socket:
    """An authenticated connection for hand-made frames."""
    sock = socket.create_connection(server.address, timeout=20)
    authenticate_as_client(sock, secret_bytes(server.secret), 20)
    return sock


def _request(sock: socket.socket, header: dict, value: bytes = b"") -> None:
    send_frame(sock, json.dumps(header).encode())
    send_frame(sock, value)


def _reply(sock: socket.socket) -> tuple[dict, bytes]:
    return json.loads(recv_frame(sock)), recv_frame(sock)


def _parked(server) -> int:
    """How many requests the server holds parked (read from the loop's state; a test's window only)."""
    return sum(1 for conn in list(server._conns.values()) if conn.parked is not None)


def _until(predicate, timeout: float = 20.0) -> None:
    """Poll a condition that no event announces (the server's internal state) within a bound."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _in_thread(func):
    """Run ``func`` on a thread; return (thread, outcome dict with 'value' or 'error', done event)."""
    outcome: dict[str, object] = {}
    done = threading.Event()

    def body():
        try:
            outcome["value"] = func()
        except BaseException as exc:  # handed to the test to assert on
            outcome["error"] = exc
        finally:
            outcome["at"] = time.monotonic()
            done.set()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome, done


def test_sixty_four_connected_clients_are_served_by_one_thread():
    before = set(threading.enumerate())
    srv = _started()
    clients: list[RendezvousClient] = []
    lock = threading.Lock()

    def connect(count: int) -> None:
        for _ in range(count):
            c = _client(srv)
            with lock:
                clients.append(c)

    try:
        connectors = [threading.Thread(target=connect, args=(8,)) for _ in range(8)]
        for t in connectors:
            t.start()
        for t in connectors:
            t.join(50)
        assert len(clients) == 64
        assert set(threading.enumerate()) - before == {srv._thread}
        assert [t.name for t in threading.enumerate() if t.name.startswith("hora-rendezvous")] == [
            "hora-rendezvous"]
        for i, c in enumerate(clients):  # every connection is live and served
            assert c.add("count", 1) == i + 1
        # All 64 parked at once, still one thread; one write answers them all.
        waiters = [_in_thread(lambda c=c: c.wait(["go"], timeout=30)) for c in clients]
        _until(lambda: _parked(srv) == 64)
        assert [t.name for t in threading.enumerate() if t.name.startswith("hora-rendezvous")] == [
            "hora-rendezvous"]
        srv.store.set("go", b"1")
        for _thread, outcome, done in waiters:  # done is set once the waiter's thread has its outcome
            assert done.wait(30)
            assert outcome.get("value") == [], outcome
    finally:
        for c in clients:
            c.close()
        srv.stop()


def test_a_parked_wait_is_answered_when_another_client_sets_the_key(server):
    with _client(server) as waiter, _client(server) as writer:
        _, outcome, done = _in_thread(lambda: waiter.wait(["k"], timeout=MAX_WAIT_SLICE))
        _until(lambda: _parked(server) == 1)
        set_at = time.monotonic()
        writer.set("k", b"v")
        assert done.wait(30)
        assert outcome["value"] == []
        assert outcome["at"] - set_at < MAX_WAIT_SLICE / 2  # answered by the write, not the slice's end


def test_a_parked_get_is_answered_when_the_launcher_writes_the_store_directly(server):
    with _client(server) as waiter:
        _, outcome, done = _in_thread(lambda: waiter.get("addr", timeout=MAX_WAIT_SLICE))
        _until(lambda: _parked(server) == 1)
        set_at = time.monotonic()
        server.store.set("addr", b"10.0.0.1:99")  # not over the socket: the store's listener wakes the loop
        assert done.wait(30)
        assert outcome["value"] == b"10.0.0.1:99"
        assert outcome["at"] - set_at < MAX_WAIT_SLICE / 2


def test_a_parked_round_wait_is_answered_by_a_round_opened_directly(server):
    with _client(server) as waiter:
        _, outcome, done = _in_thread(lambda: waiter.wait_round(-1, timeout=MAX_WAIT_SLICE))
        _until(lambda: _parked(server) == 1)
        opened_at = time.monotonic()
        server.store.open_round(2)
        assert done.wait(30)
        assert outcome["value"].generation == 0 and outcome["value"].size == 2
        assert outcome["at"] - opened_at < MAX_WAIT_SLICE / 2


def test_a_round_completing_while_a_wait_is_parked_answers_it_as_stale(server):
    store = server.store
    store.open_round(1)
    store.join_round(0, 0, "h")
    with _client(server) as waiter:
        _, outcome, done = _in_thread(lambda: waiter.wait([round_prefix(0) + "never"], timeout=20))
        _until(lambda: _parked(server) == 1)
        store.open_round(1)
        store.join_round(1, 0, "h")  # round 1 complete: round 0's keys are refused from now on
        assert done.wait(30)
        assert isinstance(outcome.get("error"), StaleRoundError)
        waiter.ping()  # the connection stays usable


def test_slices_that_expire_give_todays_missing_answers(server, monkeypatch):
    # The cap on a wait's slice, shortened so that checking it takes half a second, not five.
    slice_cap = 0.5
    monkeypatch.setattr(server_module, "MAX_WAIT_SLICE", slice_cap)
    with _raw(server) as sock:
        start = time.monotonic()
        _request(sock, {"op": "wait", "keys": ["never", "there"], "timeout": 0.3})
        server.store.set("there", b"1")
        assert _reply(sock) == ({"ok": True, "missing": ["never"]}, b"")
        assert time.monotonic() - start >= 0.3
        _request(sock, {"op": "get", "key": "never", "timeout": 0.2})
        assert _reply(sock) == ({"ok": True, "found": False}, b"")
        _request(sock, {"op": "round_wait", "newer_than": 0, "timeout": 0.2})
        assert _reply(sock) == ({"ok": True, "round": None}, b"")
        _request(sock, {"op": "get", "key": "there", "timeout": 0})
        assert _reply(sock) == ({"ok": True, "found": True}, b"1")
        start = time.monotonic()
        _request(sock, {"op": "wait", "keys": ["never"], "timeout": 3600})  # capped at MAX_WAIT_SLICE
        assert _reply(sock) == ({"ok": True, "missing": ["never"]}, b"")
        assert slice_cap <= time.monotonic() - start < slice_cap + 10


def test_requests_on_one_connection_are_answered_in_order_behind_a_parked_one(server):
    with _raw(server) as sock:
        _request(sock, {"op": "wait", "keys": ["k"], "timeout": 20})
        _request(sock, {"op": "get", "key": "k", "timeout": 0})  # sent before the first is answered
        _until(lambda: _parked(server) == 1)
        server.store.set("k", b"v")
        assert _reply(sock) == ({"ok": True, "missing": []}, b"")
        assert _reply(sock) == ({"ok": True, "found": True}, b"v")


def test_a_client_stalled_mid_frame_does_not_delay_another(server):
    header = json.dumps({"op": "ping"}).encode().ljust(100)
    with _raw(server) as stalled, _client(server) as other:
        stalled.sendall(struct.pack("!I", 100) + header[:10])  # part of a header frame, then silence
        half_hello = socket.create_connection(server.address, timeout=20)  # half a handshake, too
        half_hello.recv(64)
        half_hello.sendall(b"HORA1" + b"\1" * 10)
        try:
            start = time.monotonic()
            for i in range(200):
                other.set(f"k{i}", b"x")
                assert other.try_get(f"k{i}") == b"x"
            assert other.wait([f"k{i}" for i in range(200)], timeout=5) == []
            assert time.monotonic() - start < 20
        finally:
            half_hello.close()
        # The stalled client can still finish its request and be answered.
        stalled.sendall(header[10:] + struct.pack("!I", 0))
        assert _reply(stalled) == ({"ok": True}, b"")


def test_a_wrong_secret_is_refused_counted_and_logged(server, caplog):
    caplog.set_level(logging.WARNING, logger="hora.rendezvous.server")
    with _client(server) as good:
        for expected in (1, 2):
            with pytest.raises(AuthenticationError):
                RendezvousClient(*server.address, new_secret(), connect_timeout=10)
            assert server.refused == expected  # counted before the refused client saw the close
        good.ping()
    assert sum("rendezvous refused a connection from" in r.getMessage() for r in caplog.records) == 2


def test_a_handshake_that_never_completes_is_dropped_after_the_handshake_timeout(monkeypatch):
    monkeypatch.setattr(server_module, "HANDSHAKE_TIMEOUT", 0.3)
    secret = new_secret()
    with RendezvousServer(secret) as srv:
        with socket.create_connection(srv.address, timeout=20) as silent:
            assert len(silent.recv(64)) == 37  # the server's challenge
            start = time.monotonic()
            assert silent.recv(1) == b""  # then nothing from us: dropped
            assert time.monotonic() - start < 10
        assert srv.refused == 1


def test_an_oversized_header_closes_only_that_connection(server):
    with _client(server) as other:
        _, outcome, done = _in_thread(lambda: other.wait(["after"], timeout=20))
        _until(lambda: _parked(server) == 1)
        with _raw(server) as sock:
            sock.sendall(struct.pack("!I", server_module.MAX_HEADER_BYTES + 1))
            assert sock.recv(1) == b""
        server.store.set("after", b"1")
        assert done.wait(30) and outcome["value"] == []
        other.ping()


def test_an_eight_mebibyte_value_round_trips(server):
    value = bytes(range(256)) * (32 * 1024)  # 8 MiB
    with _client(server) as writer, _client(server) as reader:
        writer.set("big", value)
        assert reader.get("big", timeout=10) == value
        assert reader.set_if_absent("big", b"other") == value


def test_clients_that_do_not_read_or_leave_mid_reply_do_not_stall_the_others(server):
    value = b"\x5a" * (16 * 1024 * 1024)
    server.store.set("big", value)
    with _client(server) as other:
        lazy = _raw(server)
        _request(lazy, {"op": "get", "key": "big", "timeout": 0})  # never reads its reply
        leaving = _raw(server)
        _request(leaving, {"op": "get", "key": "big", "timeout": 0})
        leaving.recv(1000)
        leaving.close()  # hangs up mid-reply
        try:
            start = time.monotonic()
            for i in range(50):
                other.set(f"k{i}", b"x")
                assert other.get(f"k{i}", timeout=5) == b"x"
            assert time.monotonic() - start < 20
        finally:
            lazy.close()
        other.ping()
        _until(lambda: len(server._conns) == 1)  # both misbehaving connections are gone


def test_stop_with_parked_waits_and_open_connections_returns_promptly():
    srv = _started()
    clients = [_client(srv) for _ in range(8)]
    idle = [_client(srv) for _ in range(8)]
    try:
        waiters = [_in_thread(lambda c=c: c.wait(["never"], timeout=30)) for c in clients]
        _until(lambda: _parked(srv) == 8)
        start = time.monotonic()
        srv.stop()
        assert time.monotonic() - start < 2
        assert not srv._thread.is_alive()
        for _, outcome, done in waiters:
            assert done.wait(30)
            assert isinstance(outcome.get("error"), RendezvousError)
        for c in idle:
            with pytest.raises(RendezvousError):
                c.ping()
        with pytest.raises(RendezvousError):
            RendezvousClient(*srv.address, srv.secret, connect_timeout=0.3)
    finally:
        for c in clients + idle:
            c.close()


def test_the_store_tells_its_listeners_after_every_mutation():
    from hora.rendezvous.store import KeyValueStore

    store = KeyValueStore()
    calls: list[int] = []

    def listener() -> None:
        calls.append(1)
        store.keys()  # called outside the table's lock: reading it from the callback is safe

    store.add_listener(listener)
    store.set("a", b"1")
    store.set_if_absent("b", b"2")
    store.add("n", 1)
    store.delete("a")
    store.delete_prefix("b")
    store.open_round(1)
    store.join_round(0, 0, "h")
    assert len(calls) == 7
    store.set_if_absent("n", b"x")  # no change, no call
    store.delete("absent")
    store.remove_listener(listener)
    store.set("c", b"3")
    assert len(calls) == 7
