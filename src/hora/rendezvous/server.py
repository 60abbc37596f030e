"""The rendezvous server: an authenticated key-value store served over TCP by one thread.

The launcher (``hora run`` or :func:`hora.run`) starts one per job. Workers connect, prove they know
the job secret, then publish and look up addresses. A connection that fails the handshake is logged
and closed; it never reaches the store and cannot disturb the job. Requests are a JSON header frame
and a raw value frame, so nothing received is ever unpickled here.

Workers keep their connection for the whole job, so a thread per connection would make a launcher
hold a thread per rank. Instead one thread runs a selector over the listening socket and every
connection, each a small state machine: the handshake (:mod:`hora.rendezvous.auth`'s pure helpers),
then requests parsed from a receive buffer, replies written from a send buffer as the socket takes
them. Nothing in the loop blocks: a request that may wait (``get`` with a timeout, ``wait``,
``round_wait``) asks the store with timeout 0 and, if it cannot be answered yet, is parked until the
store changes (a store listener wakes the selector through a socket pair, since the launcher writes
to the store directly) or its slice ends. A connection's next request is read only once its
previous reply is fully sent, so replies keep their order and a client that never reads its reply
only stalls itself.
"""

from __future__ import annotations

import functools
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from hora.errors import AuthenticationError, RendezvousError
from hora.rendezvous.auth import CLIENT_REPLY_BYTES, answer_client, new_challenge, secret_bytes
from hora.rendezvous.rounds import StaleRoundError
from hora.rendezvous.store import KeyValueStore
from hora.rendezvous.wire import DEFAULT_MAX_FRAME, LENGTH_BYTES, frame_length, frame_prefix

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
# Server-side cap on one blocking wait: a client that wants longer re-issues the request, so a
# vanished client's parked request is dropped soon after its socket closes.
MAX_WAIT_SLICE = 5.0
# A request header is a small JSON object; anything longer is refused before it is read.
MAX_HEADER_BYTES = 64 * 1024
# Bytes taken from one socket per readiness event: large enough that a big value arrives in few
# calls, small enough that one sender cannot hold the loop for long.
_RECV_CHUNK = 1 << 20
# After accept() fails for want of resources (descriptors, memory), pause accepting this long
# rather than spin on a listener that stays readable.
_ACCEPT_PAUSE = 0.1

Reply = tuple[dict[str, Any], bytes]
_T = TypeVar("_T")
# A parked request's test: called with ``expired``; a reply, or None to keep waiting (never None
# once expired).
Check = Callable[[bool], "Reply | None"]


class _Parked:
    """A request that could not be answered at once: answered when ``check`` says so or at ``deadline``."""

    __slots__ = ("check", "deadline", "header")

    def __init__(self, check: Check, deadline: float, header: dict[str, Any]) -> None:
        self.check = check
        self.deadline = deadline
        self.header = header


class _Connection:
    """One client's socket and where it stands: handshake, then requests and replies."""

    __slots__ = ("sock", "peer", "inbuf", "outbuf", "authenticated", "server_nonce", "deadline",
                 "parked", "events")

    def __init__(self, sock: socket.socket, peer: tuple[Any, ...], server_nonce: bytes) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.outbuf: list[memoryview] = []  # pending reply pieces, oldest first
        self.authenticated = False
        self.server_nonce = server_nonce
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT  # of the handshake
        self.parked: _Parked | None = None
        self.events = 0  # what the selector watches for; 0: not registered

    @property
    def busy(self) -> bool:
        """Whether a request is still being answered (parked, or its reply not yet fully sent)."""
        return self.parked is not None or bool(self.outbuf)


class _FramingError(Exception):
    """The byte stream no longer splits into frames; the connection must end."""


class RendezvousServer:
    """Serves a :class:`KeyValueStore` to clients that hold the job secret, from one thread."""

    def __init__(self, secret: str | bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = KeyValueStore()
        self._secret = secret_bytes(secret)
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        self._sock.setblocking(False)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self.refused: int = 0
        self._stop = threading.Event()
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._conns: dict[socket.socket, _Connection] = {}
        # Other threads (the launcher) write to the store directly; a byte here wakes the loop.
        self._wake_recv, self._wake_send = socket.socketpair()
        self._wake_recv.setblocking(False)
        self._wake_send.setblocking(False)
        self._store_changed = False
        self._loop_ident: int | None = None
        self._accept_paused_until: float | None = None
        self._scratch = bytearray(_RECV_CHUNK)
        self._thread = threading.Thread(target=self._loop, name="hora-rendezvous", daemon=True)

    def start(self) -> RendezvousServer:
        self._thread.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def stop(self) -> None:
        """Close the listener and every connection (parked requests are dropped) and end the thread."""
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=5)
        else:
            self._close_all()  # never started (or already ended): nothing else will close them

    def __enter__(self) -> RendezvousServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the loop --------------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_send.send(b"\0")
        except OSError:
            pass  # full (the loop is already due to wake) or closed (the loop has ended)

    def _on_store_change(self) -> None:
        """The store's listener: runs on whichever thread changed the store."""
        self._store_changed = True
        if threading.get_ident() != self._loop_ident:
            self._wake()

    def _loop(self) -> None:
        self._loop_ident = threading.get_ident()
        self.store.add_listener(self._on_store_change)
        try:
            self._selector.register(self._sock, selectors.EVENT_READ)
            self._selector.register(self._wake_recv, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, mask in self._selector.select(self._select_timeout()):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is self._wake_recv:
                        self._drain_wake()
                    else:
                        conn = self._conns.get(cast(socket.socket, key.fileobj))  # only sockets are registered
                        if conn is not None:
                            self._service(conn, mask)
                if self._stop.is_set():
                    break
                changed, self._store_changed = self._store_changed, False
                self._recheck_parked(expired_only=not changed)
                self._expire_handshakes()
                self._resume_accepting()
        except Exception:  # a bug, not a client's doing: say so, and let stop() still clean up
            logger.exception("the rendezvous server loop failed")
        finally:
            self.store.remove_listener(self._on_store_change)
            self._close_all()

    def _select_timeout(self) -> float | None:
        if self._store_changed:
            return 0.0
        deadlines = [c.parked.deadline if c.parked is not None else c.deadline
                     for c in self._conns.values() if c.parked is not None or not c.authenticated]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _drain_wake(self) -> None:
        # The byte may come from a store change whose flag this loop already cleared and acted on,
        # or from one whose flag was set after: either way look again, so no change is missed.
        self._store_changed = True
        try:
            while self._wake_recv.recv(4096):
                pass
        except OSError:
            pass

    def _close_all(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns.values()):
            self._close(conn)
        for sock in (self._sock, self._wake_recv, self._wake_send):
            try:
                sock.close()
            except OSError:
                pass
        self._selector.close()

    # ---- connections -----------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, so a flood of connects cannot starve the others
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                logger.warning("rendezvous could not accept a connection: %s", exc)
                self._selector.unregister(self._sock)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE
                return
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            server_nonce, hello = new_challenge()
            conn = _Connection(sock, peer, server_nonce)
            self._conns[sock] = conn
            conn.outbuf.append(memoryview(hello))
            if self._flush(conn):
                self._update_interest(conn)

    def _resume_accepting(self) -> None:
        if self._accept_paused_until is not None and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._sock, selectors.EVENT_READ)

    def _update_interest(self, conn: _Connection) -> None:
        """Watch for what the connection can use next: its reply's room, or its next bytes.

        A connection still answering a request is not read from, so its next request waits in the
        kernel, and a client that pipelines without reading its replies throttles only itself.
        """
        events = selectors.EVENT_WRITE if conn.outbuf else 0
        if not conn.authenticated or not conn.busy:
            events |= selectors.EVENT_READ
        if events == conn.events:
            return
        if conn.events == 0:
            self._selector.register(conn.sock, events)
        elif events == 0:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events)
        conn.events = events

    def _close(self, conn: _Connection) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        if conn.events:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            conn.events = 0
        conn.parked = None
        conn.outbuf.clear()
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.sock.close()

    def _refuse(self, conn: _Connection, exc: Exception) -> None:
        self.refused += 1
        logger.warning("rendezvous refused a connection from %s:%s: %s", conn.peer[0], conn.peer[1], exc)
        self._close(conn)

    def _service(self, conn: _Connection, mask: int) -> None:
        """One readiness event of one connection; whatever goes wrong ends only this connection."""
        try:
            if mask & selectors.EVENT_WRITE and not self._flush(conn):
                return
            if mask & selectors.EVENT_READ and not self._receive(conn):
                return
            self._advance(conn)
        except Exception:  # a bug: keep serving the others
            logger.exception("rendezvous connection from %s failed", conn.peer)
            self._close(conn)

    def _flush(self, conn: _Connection) -> bool:
        """Send what the socket takes now; False if the connection ended."""
        while conn.outbuf:
            piece = conn.outbuf[0]
            try:
                sent = conn.sock.send(piece)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:
                self._lost(conn, exc)
                return False
            if sent < len(piece):
                conn.outbuf[0] = piece[sent:]
                return True
            conn.outbuf.pop(0)
        return True

    def _receive(self, conn: _Connection) -> bool:
        """Take what has arrived into the connection's buffer; False if the connection ended."""
        try:
            got = conn.sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            self._lost(conn, exc)
            return False
        if got == 0:
            if conn.authenticated:
                self._lost(conn, "closed by the client")
            else:
                self._refuse(conn, AuthenticationError(
                    f"handshake failed: connection closed after {len(conn.inbuf)} of "
                    f"{CLIENT_REPLY_BYTES} bytes"))
            return False
        conn.inbuf += memoryview(self._scratch)[:got]
        return True

    def _lost(self, conn: _Connection, why: object) -> None:
        if conn.authenticated:
            logger.debug("rendezvous connection from %s ended: %s", conn.peer, why)
            self._close(conn)
        else:
            self._refuse(conn, AuthenticationError(f"handshake failed: {why}"))

    def _advance(self, conn: _Connection) -> None:
        """Finish the handshake and answer buffered requests, one at a time, while the connection is free."""
        if not conn.authenticated:
            if len(conn.inbuf) < CLIENT_REPLY_BYTES:
                self._update_interest(conn)
                return
            reply = bytes(conn.inbuf[:CLIENT_REPLY_BYTES])
            del conn.inbuf[:CLIENT_REPLY_BYTES]
            try:
                proof = answer_client(self._secret, conn.server_nonce, reply)
            except AuthenticationError as exc:
                self._refuse(conn, exc)
                return
            conn.authenticated = True
            conn.outbuf.append(memoryview(proof))
            if not self._flush(conn):
                return
        while not conn.busy:
            try:
                request = _take_request(conn.inbuf)
            except _FramingError as exc:
                logger.debug("rendezvous connection from %s ended: %s", conn.peer, exc)
                self._close(conn)
                return
            if request is None:
                break
            raw_header, value = request
            try:
                header = json.loads(raw_header)
            except ValueError:
                header = None  # answered as a malformed request; the framing is still intact
            answer = self._handle(header, value)
            if isinstance(answer, _Parked):
                conn.parked = answer
            elif not self._reply(conn, answer):
                return
        self._update_interest(conn)

    def _reply(self, conn: _Connection, reply: Reply) -> bool:
        """Queue a reply and send what the socket takes now; False if the connection ended."""
        header = json.dumps(reply[0]).encode()
        payload = reply[1]
        conn.outbuf.append(memoryview(frame_prefix(len(header)) + header + frame_prefix(len(payload))))
        if payload:
            conn.outbuf.append(memoryview(payload))
        return self._flush(conn)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if not c.authenticated and c.deadline <= now]:
            self._refuse(conn, AuthenticationError("handshake failed: timed out"))

    def _recheck_parked(self, expired_only: bool) -> None:
        """Answer parked requests the store now satisfies (or, with ``expired_only``, whose slice ended)."""
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.parked is not None]:
            parked = conn.parked
            if parked is None:  # closed meanwhile
                continue
            expired = parked.deadline <= now
            if expired_only and not expired:
                continue
            try:
                reply = _guarded(parked.header, functools.partial(parked.check, expired))
                if reply is None:
                    continue
                conn.parked = None
                if self._reply(conn, reply):
                    self._advance(conn)
            except Exception:  # a bug: keep serving the others
                logger.exception("rendezvous connection from %s failed", conn.peer)
                self._close(conn)

    # ---- requests --------------------------------------------------------------------------------

    def _handle(self, header: object, value: bytes) -> Reply | _Parked:
        """One request's reply, or the request parked until it can be answered. A request the store
        refuses, or a malformed one, gets an error reply and the connection stays usable: only a
        broken frame (which desynchronises the stream) or a failed handshake ends a connection."""
        def dispatch() -> Reply | _Parked:
            if not isinstance(header, dict):
                raise ValueError(f"a request header must be a JSON object, got {type(header).__name__}")
            return self._dispatch(header, value)

        return _guarded(header, dispatch)

    def _dispatch(self, header: dict[str, Any], value: bytes) -> Reply | _Parked:
        op = header.get("op")
        key = str(header.get("key", ""))
        store = self.store
        if op == "set":
            store.set(key, value)
            return {"ok": True}, b""
        if op == "set_if_absent":
            return {"ok": True}, store.set_if_absent(key, value)
        if op == "get":
            def check_get(expired: bool) -> Reply | None:
                found = store.get(key, 0.0)
                if found is None and not expired:
                    return None
                return {"ok": True, "found": found is not None}, found or b""
            return _park_unless_answered(header, check_get)
        if op == "add":
            return {"ok": True, "value": store.add(key, int(header["delta"]))}, b""
        if op == "wait":
            keys = [str(k) for k in header["keys"]]

            def check_wait(expired: bool) -> Reply | None:
                missing = store.wait(keys, 0.0)
                if missing and not expired:
                    return None
                return {"ok": True, "missing": missing}, b""
            return _park_unless_answered(header, check_wait)
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
            newer_than = int(header["newer_than"])

            def check_round(expired: bool) -> Reply | None:
                found_round = store.wait_round(newer_than, 0.0)
                if found_round is None and not expired:
                    return None
                return {"ok": True, "round": None if found_round is None else found_round.to_json()}, b""
            return _park_unless_answered(header, check_round)
        if op == "round_join":
            joined = store.join_round(int(header["generation"]), int(header["rank"]), str(header["hostname"]))
            return {"ok": True, "round": joined.to_json()}, b""
        return {"ok": False, "error": f"unknown rendezvous op {op!r}"}, b""


def _guarded(header: object, answer: Callable[[], _T]) -> _T | Reply:
    """``answer()``, with the errors a request may meet turned into error replies."""
    try:
        return answer()
    except StaleRoundError as exc:
        return {"ok": False, "error": str(exc), "kind": "stale_round"}, b""
    except RendezvousError as exc:
        return {"ok": False, "error": str(exc)}, b""
    except (KeyError, ValueError, TypeError) as exc:
        return {"ok": False, "error": f"malformed rendezvous request {header!r:.200}: "
                                      f"{type(exc).__name__}: {exc}"}, b""


def _park_unless_answered(header: dict[str, Any], check: Check) -> Reply | _Parked:
    """Answer a waiting request now if it can be; otherwise park it for its (capped) slice."""
    slice_s = _wait_slice(header)
    deadline = time.monotonic() + slice_s
    reply = check(slice_s <= 0)
    return reply if reply is not None else _Parked(check, deadline, header)


def _take_request(inbuf: bytearray) -> tuple[bytes, bytes] | None:
    """Remove one whole request (header frame, value frame) from the front of ``inbuf``; None if
    it has not all arrived. A header longer than MAX_HEADER_BYTES (or a value longer than the wire
    limit) raises :class:`_FramingError` as soon as its length is known, before it is read."""
    if len(inbuf) < LENGTH_BYTES:
        return None
    header_len = frame_length(inbuf)
    if header_len > MAX_HEADER_BYTES:
        raise _FramingError(f"frame of {header_len} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    value_at = LENGTH_BYTES + header_len
    if len(inbuf) < value_at + LENGTH_BYTES:
        return None
    value_len = frame_length(inbuf, value_at)
    if value_len > DEFAULT_MAX_FRAME:
        raise _FramingError(f"frame of {value_len} bytes exceeds the limit of {DEFAULT_MAX_FRAME}")
    end = value_at + LENGTH_BYTES + value_len
    if len(inbuf) < end:
        return None
    with memoryview(inbuf) as view:
        raw_header = bytes(view[LENGTH_BYTES:value_at])
        value = bytes(view[value_at + LENGTH_BYTES : end])
    del inbuf[:end]
    return raw_header, value


def _wait_slice(header: dict[str, Any]) -> float:
    """The blocking time a request asks for, capped so a vanished client's request is dropped soon."""
    return max(0.0, min(float(header.get("timeout", 0.0)), MAX_WAIT_SLICE))
