"""The rendezvous server: an authenticated key-value store served over TCP.

The launcher (``hora run`` or :func:`hora.run`) starts one per job. Workers connect, prove they know
the job secret, then publish and look up addresses. A connection that fails the handshake is logged
and closed; it never reaches the store and cannot disturb the job. Requests are a JSON header frame
and a raw value frame, so nothing received is ever unpickled here.
"""

from __future__ import annotations

import json
import logging
import socket
import threading

from hora.errors import AuthenticationError, RendezvousError
from hora.rendezvous.auth import authenticate_as_server, secret_bytes
from hora.rendezvous.rounds import StaleRoundError
from hora.rendezvous.store import KeyValueStore
from hora.rendezvous.wire import ConnectionClosed, recv_frame, send_frame

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
# Server-side cap on one blocking wait: a client that wants longer re-issues the request, so a
# vanished client frees its thread soon after its socket closes.
MAX_WAIT_SLICE = 5.0
# A request header is a small JSON object; anything longer is refused before it is read.
MAX_HEADER_BYTES = 64 * 1024


class RendezvousServer:
    """Serves a :class:`KeyValueStore` to clients that hold the job secret."""

    def __init__(self, secret: str | bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = KeyValueStore()
        self._secret = secret_bytes(secret)
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        self._sock.settimeout(0.5)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self.refused: int = 0
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="hora-rendezvous", daemon=True)

    def start(self) -> "RendezvousServer":
        self._thread.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def __enter__(self) -> "RendezvousServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            threading.Thread(
                target=self._serve, args=(conn, peer), name=f"hora-rendezvous-{peer}", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                authenticate_as_server(conn, self._secret, HANDSHAKE_TIMEOUT)
            except AuthenticationError as exc:
                with self._conns_lock:  # handshakes fail on many threads at once
                    self.refused += 1
                logger.warning("rendezvous refused a connection from %s:%s: %s", peer[0], peer[1], exc)
                return
            while not self._stop.is_set():
                try:
                    raw_header = recv_frame(conn, MAX_HEADER_BYTES)
                    value = recv_frame(conn)
                except (ConnectionClosed, OSError):
                    return
                try:
                    header = json.loads(raw_header)
                except ValueError:
                    header = None  # answered as a malformed request; the framing is still intact
                reply, payload = self._handle(header, value)
                send_frame(conn, json.dumps(reply).encode())
                send_frame(conn, payload)
        except (OSError, RendezvousError, ValueError) as exc:
            logger.debug("rendezvous connection from %s ended: %s", peer, exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, header: object, value: bytes) -> tuple[dict, bytes]:
        """One request's reply. A request the store refuses, or a malformed one, gets an error reply
        and the connection stays usable: only a broken frame (which desynchronises the stream) or a
        failed handshake ends a connection."""
        try:
            if not isinstance(header, dict):
                raise ValueError(f"a request header must be a JSON object, got {type(header).__name__}")
            return self._dispatch(header, value)
        except StaleRoundError as exc:
            return {"ok": False, "error": str(exc), "kind": "stale_round"}, b""
        except RendezvousError as exc:
            return {"ok": False, "error": str(exc)}, b""
        except (KeyError, ValueError, TypeError) as exc:
            return {"ok": False, "error": f"malformed rendezvous request {header!r:.200}: "
                                          f"{type(exc).__name__}: {exc}"}, b""

    def _dispatch(self, header: dict, value: bytes) -> tuple[dict, bytes]:
        op = header.get("op")
        key = str(header.get("key", ""))
        store = self.store
        if op == "set":
            store.set(key, value)
            return {"ok": True}, b""
        if op == "set_if_absent":
            return {"ok": True}, store.set_if_absent(key, value)
        if op == "get":
            found = store.get(key, _wait_slice(header))
            return ({"ok": True, "found": found is not None}, found or b"")
        if op == "add":
            return {"ok": True, "value": store.add(key, int(header["delta"]))}, b""
        if op == "wait":
            return {"ok": True, "missing": store.wait([str(k) for k in header["keys"]], _wait_slice(header))}, b""
        if op == "delete":
            return {"ok": True, "deleted": store.delete(key)}, b""
        if op == "keys":
            return {"ok": True, "keys": store.keys(str(header.get("prefix", "")))}, b""
        if op == "ping":
            return {"ok": True}, b""
        if op == "round_open":
            expect = header.get("expect_current")
            opened = store.open_round(int(header["size"]), [tuple(h) for h in header.get("hosts", ())],
                                      None if expect is None else int(expect),
                                      supersede=bool(header.get("supersede", False)),
                                      announcement=header.get("announcement"))
            return {"ok": True, "round": opened.to_json()}, b""
        if op == "round_get":
            generation = header.get("generation")
            found_round = store.get_round(None if generation is None else int(generation))
            return {"ok": True, "round": None if found_round is None else found_round.to_json()}, b""
        if op == "round_wait":
            found_round = store.wait_round(int(header["newer_than"]), _wait_slice(header))
            return {"ok": True, "round": None if found_round is None else found_round.to_json()}, b""
        if op == "round_join":
            joined = store.join_round(int(header["generation"]), int(header["rank"]), str(header["hostname"]))
            return {"ok": True, "round": joined.to_json()}, b""
        return {"ok": False, "error": f"unknown rendezvous op {op!r}"}, b""


def _wait_slice(header: dict) -> float:
    """The blocking time a request asks for, capped so a vanished client frees its thread soon."""
    return max(0.0, min(float(header.get("timeout", 0.0)), MAX_WAIT_SLICE))
