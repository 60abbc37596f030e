"""The rendezvous server and client over real sockets: requests, strangers, malformed input, bounds."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest

from hora.errors import AuthenticationError, RendezvousError
from hora.rendezvous.auth import authenticate_as_server, new_secret, secret_bytes
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.server import RendezvousServer
from hora.rendezvous.wire import recv_frame, send_frame

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    secret = new_secret()
    srv = RendezvousServer(secret).start()
    srv.secret = secret
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with RendezvousClient(*server.address, server.secret, connect_timeout=10) as c:
        yield c


def test_every_request_round_trips(client):
    client.set("a", b"1")
    assert client.try_get("a") == b"1"
    assert client.get("a", timeout=1) == b"1"
    assert client.set_if_absent("a", b"2") == b"1"
    assert client.add("n", 5) == 5 and client.add("n", -2) == 3
    assert client.keys("") == ["a", "n"]
    assert client.wait(["a", "n", "z"], timeout=0.1) == ["z"]
    assert client.delete("a") is True and client.try_get("a") is None
    client.ping()


def test_a_blocking_get_sees_another_clients_write(server, client):
    def later():
        time.sleep(0.2)
        with RendezvousClient(*server.address, server.secret) as other:
            other.set("late", b"v")

    writer = threading.Thread(target=later)
    writer.start()
    assert client.get("late", timeout=20) == b"v"
    writer.join()


def test_a_get_that_never_sees_its_key_names_it_within_the_timeout(client):
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="'never'.*did not appear"):
        client.get("never", timeout=0.3)
    assert time.monotonic() - start < 10


def test_a_wrong_secret_is_refused_and_the_server_keeps_serving(server, client):
    with pytest.raises(AuthenticationError):
        RendezvousClient(*server.address, new_secret(), connect_timeout=5)
    deadline = time.monotonic() + 10
    while server.refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.refused == 1
    assert server.store.keys() == []
    client.set("still", b"served")
    assert client.try_get("still") == b"served"


def test_garbage_and_truncated_connections_do_not_disturb_the_job(server, client):
    with socket.create_connection(server.address, timeout=5) as raw:
        raw.sendall(b"\x00\xffgarbage" * 100)
    with socket.create_connection(server.address, timeout=5) as raw:
        raw.recv(64)
        raw.sendall(b"HORA1" + b"\1" * 10)  # a handshake cut short
    client.set("k", b"v")
    assert client.try_get("k") == b"v"


def _authenticated_socket(server) -> socket.socket:
    """A raw connection that passed the handshake, to send hand-made frames."""
    from hora.rendezvous.auth import authenticate_as_client

    sock = socket.create_connection(server.address, timeout=10)
    authenticate_as_client(sock, secret_bytes(server.secret), 10)
    return sock


@pytest.mark.parametrize("header", [b"{not json", b"[1, 2]", json.dumps({"op": "add", "key": "k"}).encode(),
                                    json.dumps({"op": "wait"}).encode(), json.dumps({"op": "nonsense"}).encode()])
def test_a_malformed_request_gets_an_error_reply_and_the_connection_stays_usable(server, header):
    with _authenticated_socket(server) as sock:
        send_frame(sock, header)
        send_frame(sock, b"")
        reply = json.loads(recv_frame(sock))
        assert reply["ok"] is False and reply["error"]
        assert recv_frame(sock) == b""
        send_frame(sock, json.dumps({"op": "ping"}).encode())
        send_frame(sock, b"")
        assert json.loads(recv_frame(sock)) == {"ok": True}


def test_a_refused_request_raises_its_reason_and_the_client_stays_usable(client):
    client.set("blob", b"text")
    with pytest.raises(RendezvousError, match="not an integer") as info:
        client.add("blob", 1)
    assert "launcher has probably exited" not in str(info.value)
    client.ping()
    assert client.try_get("blob") == b"text"


def test_an_oversized_header_ends_only_that_connection(server, client):
    with _authenticated_socket(server) as sock:
        sock.sendall(struct.pack("!I", 1 << 30))
        sock.settimeout(10)
        assert sock.recv(1) == b""  # the server hung up without reading a gigabyte
    client.ping()


def test_connecting_where_no_server_listens_fails_within_the_connect_timeout():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound but not listening: connections are refused
        start = time.monotonic()
        with pytest.raises(RendezvousError, match="cannot reach the rendezvous store"):
            RendezvousClient("127.0.0.1", port, new_secret(), connect_timeout=0.5)
    assert time.monotonic() - start < 10


def test_a_server_that_never_answers_the_handshake_fails_the_client_within_a_bound():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog) but never speaks
        start = time.monotonic()
        with pytest.raises(AuthenticationError):
            RendezvousClient("127.0.0.1", silent.getsockname()[1], new_secret(), connect_timeout=0.5)
    assert time.monotonic() - start < 50  # the handshake bound is 5 s


def test_a_request_that_timed_out_never_hands_its_late_reply_to_the_next_request():
    """A server slower than the client's patience: the late reply must not answer a later request."""
    secret = new_secret()
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def slow_server():
        conn, _ = listener.accept()
        with conn:
            try:
                authenticate_as_server(conn, secret_bytes(secret), 10)
                for answer in (b"first", b"second"):
                    recv_frame(conn), recv_frame(conn)
                    if answer == b"first":
                        release.wait(20)
                    send_frame(conn, json.dumps({"ok": True, "found": True}).encode())
                    send_frame(conn, answer)
            except (OSError, RendezvousError):
                pass  # the client hung up, as it should

    thread = threading.Thread(target=slow_server, daemon=True)
    thread.start()
    try:
        client = RendezvousClient("127.0.0.1", listener.getsockname()[1], secret, io_timeout=0.5)
        with pytest.raises(RendezvousError, match="timed out"):
            client.try_get("first")
        release.set()
        time.sleep(0.2)  # the late reply to "first" is now in the socket
        with pytest.raises(RendezvousError):
            assert client.try_get("second") == b"second"
        client.close()
    finally:
        release.set()
        listener.close()
        thread.join(10)


def test_stop_ends_the_accept_thread_and_open_connections():
    secret = new_secret()
    srv = RendezvousServer(secret).start()
    client = RendezvousClient(*srv.address, secret)
    srv.stop()
    assert not srv._thread.is_alive()
    with pytest.raises(RendezvousError, match="lost the rendezvous store"):
        client.ping()
    client.close()


def test_a_garbled_reply_is_a_rendezvous_error_and_retires_the_connection():
    secret = new_secret()
    listener = socket.create_server(("127.0.0.1", 0))

    def garbling_server():
        conn, _ = listener.accept()
        with conn:
            try:
                authenticate_as_server(conn, secret_bytes(secret), 10)
                recv_frame(conn), recv_frame(conn)
                send_frame(conn, b"\xff not json")
                send_frame(conn, b"")
                recv_frame(conn)  # a second request must never come
            except (OSError, RendezvousError):
                pass

    thread = threading.Thread(target=garbling_server, daemon=True)
    thread.start()
    try:
        client = RendezvousClient("127.0.0.1", listener.getsockname()[1], secret)
        with pytest.raises(RendezvousError, match="rendezvous store"):
            client.ping()
        with pytest.raises(RendezvousError):
            client.ping()
        client.close()
    finally:
        listener.close()
        thread.join(10)
