"""Length-prefixed framing on stream sockets.

Every hora control connection (rendezvous, peer handshakes) speaks in frames: a 4-byte big-endian
length and that many bytes. A frame larger than ``max_bytes`` is refused before anything is
allocated, so a stranger cannot make a process reserve gigabytes by sending a length. The blocking
helpers serve clients and peer handshakes; ``frame_prefix`` and ``frame_length`` let a non-blocking
reader (the rendezvous server's selector loop) build and parse the same frames in its own buffers.
"""

from __future__ import annotations

import socket
import struct

from hora.errors import RendezvousError

_LEN = struct.Struct("!I")
LENGTH_BYTES = _LEN.size
DEFAULT_MAX_FRAME = 512 * 1024 * 1024


class ConnectionClosed(RendezvousError):
    """The other side closed the connection."""


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Read exactly ``nbytes`` or raise :class:`ConnectionClosed`."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[got:], nbytes - got)
        if n == 0:
            raise ConnectionClosed(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return bytes(buf)


def frame_prefix(length: int) -> bytes:
    """The length prefix of a frame of ``length`` bytes."""
    return _LEN.pack(length)


def frame_length(buf: bytes | bytearray, offset: int = 0) -> int:
    """The length a frame prefix at ``buf[offset:]`` announces (``LENGTH_BYTES`` must be there)."""
    length: int = _LEN.unpack_from(buf, offset)[0]
    return length


def send_frame(sock: socket.socket, payload: bytes) -> None:
    header = frame_prefix(len(payload))
    if len(payload) < 65536:
        sock.sendall(header + payload)  # one segment for small control messages
    else:
        sock.sendall(header)
        sock.sendall(payload)


def recv_frame(sock: socket.socket, max_bytes: int = DEFAULT_MAX_FRAME) -> bytes:
    length = frame_length(recv_exact(sock, LENGTH_BYTES))
    if length > max_bytes:
        raise RendezvousError(f"frame of {length} bytes exceeds the limit of {max_bytes}")
    return recv_exact(sock, length) if length else b""
