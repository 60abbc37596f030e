"""Framing and the challenge-response handshake, over socket pairs (no server)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from hora.errors import AuthenticationError, RendezvousError
from hora.rendezvous.auth import (
    MAGIC,
    authenticate_as_client,
    authenticate_as_server,
    new_secret,
    secret_bytes,
)
from hora.rendezvous.wire import ConnectionClosed, recv_exact, recv_frame, send_frame

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("payload", [b"", b"x", b"hello" * 1000, bytes(range(256)) * 1024])
def test_frames_arrive_whole_and_in_order(pair, payload):
    a, b = pair
    sender = threading.Thread(target=lambda: (send_frame(a, payload), send_frame(a, b"next")))
    sender.start()
    assert recv_frame(b) == payload
    assert recv_frame(b) == b"next"
    sender.join()


def test_a_frame_longer_than_the_limit_is_refused_before_it_is_read(pair):
    a, b = pair
    a.sendall(struct.pack("!I", 1 << 31))  # claims 2 GiB, sends nothing more
    with pytest.raises(RendezvousError, match="exceeds the limit"):
        recv_frame(b, max_bytes=1024)


def test_a_truncated_frame_raises_connection_closed(pair):
    a, b = pair
    a.sendall(struct.pack("!I", 100) + b"only ten b")
    a.close()
    with pytest.raises(ConnectionClosed, match="after 10 of 100 bytes"):
        recv_frame(b)


def test_a_truncated_length_prefix_raises_connection_closed(pair):
    a, b = pair
    a.sendall(b"\x00\x00")
    a.close()
    with pytest.raises(ConnectionClosed):
        recv_frame(b)


def test_recv_exact_of_zero_bytes_returns_at_once(pair):
    assert recv_exact(pair[1], 0) == b""


def _handshake(server_secret: str, client_secret: str) -> tuple[object, object]:
    """Run both sides of the handshake; each side's outcome (None or the exception)."""
    a, b = socket.socketpair()
    outcome: dict[str, object] = {}

    def side(name, func, sock, secret):
        try:
            func(sock, secret_bytes(secret), 10.0)
            outcome[name] = None
        except Exception as exc:
            outcome[name] = exc
        finally:
            sock.close()

    threads = [threading.Thread(target=side, args=("server", authenticate_as_server, a, server_secret)),
               threading.Thread(target=side, args=("client", authenticate_as_client, b, client_secret))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcome["server"], outcome["client"]


def test_both_sides_holding_the_secret_authenticate():
    secret = new_secret()
    assert _handshake(secret, secret) == (None, None)


def test_a_wrong_secret_is_refused_by_the_server_and_the_client_learns_it():
    server, client = _handshake(new_secret(), new_secret())
    assert isinstance(server, AuthenticationError) and "secret" in str(server)
    assert isinstance(client, AuthenticationError)


def test_a_peer_that_does_not_speak_the_protocol_is_refused(pair):
    a, b = pair
    b.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 100)
    with pytest.raises(AuthenticationError, match="protocol"):
        authenticate_as_server(a, secret_bytes(new_secret()), 10.0)


def test_a_server_that_does_not_speak_the_protocol_is_refused(pair):
    a, b = pair
    a.sendall(b"NOTME" + b"\0" * 32)
    with pytest.raises(AuthenticationError, match="protocol"):
        authenticate_as_client(b, secret_bytes(new_secret()), 10.0)


def test_a_peer_that_hangs_up_mid_handshake_is_an_authentication_error(pair):
    a, b = pair
    b.sendall(MAGIC + b"\0" * 5)
    b.close()
    with pytest.raises(AuthenticationError, match="handshake failed"):
        authenticate_as_server(a, secret_bytes(new_secret()), 10.0)


def test_a_silent_peer_times_out_the_handshake_within_its_bound(pair):
    a, _ = pair
    with pytest.raises(AuthenticationError, match="handshake failed"):
        authenticate_as_server(a, secret_bytes(new_secret()), 0.3)
    assert a.gettimeout() == 10  # the caller's timeout is restored


def test_a_secret_that_is_not_hex_is_a_clear_error():
    with pytest.raises(AuthenticationError, match="not valid hex"):
        secret_bytes("not-hex!")
    assert secret_bytes(b"raw") == b"raw"
    assert len(secret_bytes(new_secret())) == 32
