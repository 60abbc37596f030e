"""Client of the rendezvous store, used by workers and by the launcher's helpers."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Iterable

from hora.errors import RendezvousError
from hora.rendezvous.auth import authenticate_as_client, secret_bytes
from hora.rendezvous.server import MAX_WAIT_SLICE
from hora.rendezvous.wire import ConnectionClosed, recv_frame, send_frame

CONNECT_RETRY_SECONDS = 0.05


class RendezvousClient:
    """One authenticated connection to the job's store; safe to share between threads."""

    def __init__(
        self, host: str, port: int, secret: str | bytes, connect_timeout: float = 30.0
    ) -> None:
        self.host = host
        self.port = int(port)
        self._secret = secret_bytes(secret)
        self._lock = threading.Lock()
        self._sock = self._connect(connect_timeout)

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(1.0, timeout))
                break
            except OSError as exc:
                last_error = exc
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"cannot reach the rendezvous store at {self.host}:{self.port} "
                        f"within {timeout:.0f} s ({last_error}); is the launcher still running?"
                    ) from None
                time.sleep(CONNECT_RETRY_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        authenticate_as_client(sock, self._secret, timeout=max(5.0, timeout))
        sock.settimeout(MAX_WAIT_SLICE + 30.0)
        return sock

    def close(self) -> None:
        with self._lock:
            try:
                self._sock.close()
            except OSError:
                pass

    def __enter__(self) -> "RendezvousClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, header: dict, value: bytes = b"") -> tuple[dict, bytes]:
        with self._lock:
            try:
                send_frame(self._sock, json.dumps(header).encode())
                send_frame(self._sock, value)
                reply = json.loads(recv_frame(self._sock, 64 * 1024 * 1024))
                payload = recv_frame(self._sock)
            except (OSError, ConnectionClosed) as exc:
                raise RendezvousError(
                    f"lost the rendezvous store at {self.host}:{self.port} ({exc}); "
                    "the launcher has probably exited"
                ) from None
        if not reply.get("ok"):
            raise RendezvousError(reply.get("error", "rendezvous request failed"))
        return reply, payload

    def set(self, key: str, value: bytes) -> None:
        self._call({"op": "set", "key": key}, value)

    def set_if_absent(self, key: str, value: bytes) -> bytes:
        """Store unless present; return the value that won."""
        return self._call({"op": "set_if_absent", "key": key}, value)[1]

    def add(self, key: str, delta: int = 1) -> int:
        return int(self._call({"op": "add", "key": key, "delta": int(delta)})[0]["value"])

    def delete(self, key: str) -> bool:
        return bool(self._call({"op": "delete", "key": key})[0]["deleted"])

    def keys(self, prefix: str = "") -> list[str]:
        return list(self._call({"op": "keys", "prefix": prefix})[0]["keys"])

    def ping(self) -> None:
        self._call({"op": "ping"})

    def try_get(self, key: str) -> bytes | None:
        reply, payload = self._call({"op": "get", "key": key, "timeout": 0.0})
        return payload if reply["found"] else None

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` s; RendezvousError names the key if absent."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            reply, payload = self._call(
                {"op": "get", "key": key, "timeout": max(0.0, min(remaining, MAX_WAIT_SLICE))}
            )
            if reply["found"]:
                return payload
            if time.monotonic() >= deadline:
                raise RendezvousError(f"key {key!r} did not appear within {timeout:.1f} s")

    def wait(self, keys: Iterable[str], timeout: float) -> list[str]:
        """Wait for every key; return those still missing after ``timeout`` seconds (empty: all there)."""
        wanted = list(keys)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            reply, _ = self._call(
                {"op": "wait", "keys": wanted, "timeout": max(0.0, min(remaining, MAX_WAIT_SLICE))}
            )
            wanted = list(reply["missing"])
            if not wanted or time.monotonic() >= deadline:
                return wanted
