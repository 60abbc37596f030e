"""Client of the rendezvous store, used by workers and by the launcher's helpers."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from hora.errors import RendezvousError
from hora.rendezvous.auth import authenticate_as_client, secret_bytes
from hora.rendezvous.rounds import Round, StaleRoundError
from hora.rendezvous.server import MAX_WAIT_SLICE
from hora.rendezvous.wire import recv_frame, send_frame

CONNECT_RETRY_SECONDS = 0.05


class RendezvousClient:
    """One authenticated connection to the job's store; safe to share between threads."""

    def __init__(
        self, host: str, port: int, secret: str | bytes, connect_timeout: float = 30.0,
        io_timeout: float = MAX_WAIT_SLICE + 30.0,
    ) -> None:
        """Connect and authenticate within ``connect_timeout`` s; afterwards a request whose reply
        takes longer than ``io_timeout`` s (the server answers every request within its wait slice)
        fails, and so does every later request on this client."""
        self.host = host
        self.port = int(port)
        self._secret = secret_bytes(secret)
        self._lock = threading.Lock()
        self._io_timeout = float(io_timeout)
        self._broken: str | None = None
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
        try:
            authenticate_as_client(sock, self._secret, timeout=max(5.0, timeout))
        except BaseException:
            sock.close()
            raise
        sock.settimeout(self._io_timeout)
        return sock

    def close(self) -> None:
        with self._lock:
            try:
                self._sock.close()
            except OSError:
                pass

    def __enter__(self) -> RendezvousClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, header: dict[str, Any], value: bytes = b"") -> tuple[dict[str, Any], bytes]:
        with self._lock:
            if self._broken is not None:
                raise RendezvousError(self._broken)
            try:
                send_frame(self._sock, json.dumps(header).encode())
                send_frame(self._sock, value)
                reply = json.loads(recv_frame(self._sock, 64 * 1024 * 1024))
                payload = recv_frame(self._sock)
            except (OSError, RendezvousError, ValueError) as exc:
                # A reply may still be on its way: the stream is out of step, so no later request
                # may read from it (it would take this request's reply as its own).
                what = "timed out waiting for" if isinstance(exc, socket.timeout) else "lost"
                self._broken = (f"{what} the rendezvous store at {self.host}:{self.port} ({exc}); "
                                "the launcher has probably exited")
                try:
                    self._sock.close()
                except OSError:
                    pass
                raise RendezvousError(self._broken) from None
        if not reply.get("ok"):
            error = reply.get("error", "rendezvous request failed")
            raise StaleRoundError(error) if reply.get("kind") == "stale_round" else RendezvousError(error)
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

    # ---- rounds (see hora.rendezvous.rounds) ------------------------------------------------------

    def open_round(self, size: int, hosts: Iterable[tuple[str, int]] = (),
                   expect_current: int | None = None, supersede: bool = False,
                   announcement: int | None = None) -> Round:
        """Open the next round; see :meth:`KeyValueStore.open_round`."""
        header = {"op": "round_open", "size": int(size), "hosts": [[str(h), int(s)] for h, s in hosts],
                  "expect_current": expect_current, "supersede": bool(supersede),
                  "announcement": announcement}
        return Round.from_json(self._call(header)[0]["round"])

    def get_round(self, generation: int | None = None) -> Round | None:
        """A round by generation (default: the current one); None if never opened or already gone."""
        data = self._call({"op": "round_get", "generation": generation})[0]["round"]
        return None if data is None else Round.from_json(data)

    def wait_round(self, newer_than: int, timeout: float) -> Round | None:
        """The current round once one newer than ``newer_than`` is open; None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            data = self._call({"op": "round_wait", "newer_than": int(newer_than),
                               "timeout": max(0.0, min(remaining, MAX_WAIT_SLICE))})[0]["round"]
            if data is not None:
                return Round.from_json(data)
            if time.monotonic() >= deadline:
                return None

    def join_round(self, generation: int, rank: int, hostname: str) -> Round:
        """Take ``rank`` in round ``generation``; :class:`StaleRoundError` if a newer round is open."""
        header = {"op": "round_join", "generation": int(generation), "rank": int(rank), "hostname": hostname}
        return Round.from_json(self._call(header)[0]["round"])
