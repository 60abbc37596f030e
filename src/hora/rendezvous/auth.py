"""Proof that both ends of a connection hold the job secret.

The launcher generates a fresh random secret per job and hands it to workers in their environment.
Every connection, to the rendezvous store or between workers, starts with a mutual challenge-response:
each side sends a fresh nonce and answers the other's with HMAC-SHA256 over both nonces and its role.
The secret never crosses the wire, a recorded exchange cannot be replayed (fresh nonces), and a side
that fails is dropped before any of its bytes are interpreted, so no data from a stranger is ever
unpickled. The server's side is also two pure functions (:func:`new_challenge`,
:func:`answer_client`), used by :func:`authenticate_as_server` and by the rendezvous server's
non-blocking loop alike, so the protocol has one implementation.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from hora.errors import AuthenticationError, RendezvousError
from hora.rendezvous.wire import recv_exact

MAGIC = b"HORA1"
NONCE_BYTES = 32
DIGEST_BYTES = 32
# What the server sends first (its challenge), and what the client answers with.
HELLO_BYTES = len(MAGIC) + NONCE_BYTES
CLIENT_REPLY_BYTES = HELLO_BYTES + DIGEST_BYTES


def new_secret() -> str:
    """A fresh job secret, hex-encoded so it travels in an environment variable."""
    return secrets.token_hex(32)


def secret_bytes(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        return secret
    try:
        return bytes.fromhex(secret)
    except ValueError:
        raise AuthenticationError("the job secret is not valid hex; was HORA_SECRET altered?") from None


def _mac(key: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, role + server_nonce + client_nonce, hashlib.sha256).digest()


def new_challenge() -> tuple[bytes, bytes]:
    """A fresh server nonce and the hello that carries it (the server's first bytes)."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    return server_nonce, MAGIC + server_nonce


def answer_client(secret: bytes, server_nonce: bytes, reply: bytes) -> bytes:
    """Check a client's reply (``CLIENT_REPLY_BYTES``) to ``server_nonce``; return the server's proof.

    Pure, so a blocking server and a non-blocking one (the rendezvous selector loop) share one
    implementation of the protocol. Raises AuthenticationError if the client does not know the secret.
    """
    if len(reply) != CLIENT_REPLY_BYTES or reply[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("peer does not speak the hora protocol")
    client_nonce = reply[len(MAGIC) : HELLO_BYTES]
    proof = reply[HELLO_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", server_nonce, client_nonce)):
        raise AuthenticationError("peer failed to prove it knows the job secret")
    return _mac(secret, b"server", server_nonce, client_nonce)


def authenticate_as_server(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Challenge a connecting peer; raise AuthenticationError if it does not know the secret."""
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        server_nonce, hello = new_challenge()
        sock.sendall(hello)
        reply = recv_exact(sock, CLIENT_REPLY_BYTES)
        sock.sendall(answer_client(secret, server_nonce, reply))
    except AuthenticationError:
        raise
    except (OSError, RendezvousError) as exc:
        raise AuthenticationError(f"handshake failed: {exc}") from None
    finally:
        sock.settimeout(previous)


def authenticate_as_client(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Answer the server's challenge and check that the server knows the secret too."""
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            raise AuthenticationError("server does not speak the hora protocol")
        server_nonce = hello[len(MAGIC) :]
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(MAGIC + client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
        proof = recv_exact(sock, DIGEST_BYTES)
        if not hmac.compare_digest(proof, _mac(secret, b"server", server_nonce, client_nonce)):
            raise AuthenticationError("server failed to prove it knows the job secret")
    except AuthenticationError:
        raise
    except (OSError, RendezvousError) as exc:
        raise AuthenticationError(
            f"handshake failed ({exc}); the server may have refused our secret"
        ) from None
    finally:
        sock.settimeout(previous)
