"""Forwarding workers' output to the launcher, one whole line at a time.

Every worker's stdout and stderr are pipes, all read by one thread through a selector (a thread per
pipe would cost a 64-rank job 128 threads). Each pipe keeps its own partial line; a complete line is
written to the launcher's stream with Horovod's prefix (``[3]<stdout>:``), so lines from different
ranks never interleave mid-line and each rank's lines keep their order. At end of file the last
partial line is forwarded too, so nothing a worker wrote before exiting is lost. Bytes are decoded
with ``errors="replace"``: a worker printing binary garbage cannot crash the launcher. With an output
directory, each rank's raw bytes also go to ``DIR/rank.<N>/stdout`` and ``DIR/rank.<N>/stderr``
(Horovod's layout).

The router also watches each rank's stderr for Python tracebacks and remembers the exception line
of the last one (:class:`TracebackWatcher`), so the launcher can say *why* a worker failed
("ValueError: bad input") and not only its exit status. Reading the rank's own stderr works for
any Python worker, whether or not it imports hora, and for ranks started over SSH, whose stderr
arrives through the same pipe. With ``timestamps``, each forwarded line starts with the local time
it arrived (``--prefix-output-with-timestamp``).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import selectors
import sys
import threading
from collections.abc import Callable
from typing import BinaryIO, TextIO

logger = logging.getLogger(__name__)

# A line longer than this is forwarded in pieces, each on its own prefixed line, so a worker that
# writes megabytes without a newline cannot make the launcher buffer all of it.
MAX_LINE_BYTES = 64 * 1024


# Longest exception line kept for the launcher's failure line.
MAX_EXCEPTION_CHARS = 300
_TRACEBACK_HEADER = "Traceback (most recent call last):"
_GROUP_HEADER = "+ Exception Group Traceback (most recent call last):"
# ``ValueError``, ``ValueError: message``, ``package.module.Error: message``.
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(: .*)?")
# Colour codes Python 3.13+ puts in tracebacks when told to (PYTHON_COLORS, FORCE_COLOR).
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class TracebackWatcher:
    """Finds the exception line of the last Python traceback in one rank's stderr.

    Python prints an uncaught exception as a ``Traceback (most recent call last):`` header,
    indented frame lines, and then the exception at column 0 (``KeyError: 'lr'``); chained
    exceptions repeat the pattern, the one that ended the program coming last. The watcher keeps
    the first line of the last such exception. It is fed whole lines by the output thread and
    costs one string comparison per line outside a traceback. Exception groups (Python 3.11+)
    print their tracebacks inside ``  | `` margins, which are looked through.
    """

    __slots__ = ("last", "_inside", "_margin")

    def __init__(self) -> None:
        self.last: str | None = None
        self._inside = False
        self._margin = ""

    def feed(self, line: str) -> None:
        """Take one line of stderr (with or without its newline)."""
        if not self._inside:
            if "\x1b" in line:
                line = _ANSI_COLOUR.sub("", line)
            if line.startswith(_TRACEBACK_HEADER):
                self._inside, self._margin = True, ""
            elif line.lstrip(" ").startswith(_GROUP_HEADER):
                self._inside, self._margin = True, "  | "
            return
        line = _ANSI_COLOUR.sub("", line.rstrip("\r\n"))
        if self._margin and line.startswith(self._margin):
            line = line[len(self._margin):]
        if not line or line[0].isspace():
            return  # a frame, its source line, or a caret line
        self._inside = False
        if _EXCEPTION_LINE.fullmatch(line):
            if len(line) > MAX_EXCEPTION_CHARS:
                line = line[:MAX_EXCEPTION_CHARS - 3] + "..."
            self.last = line


def rank_directory_name(rank: int, size: int) -> str:
    """``rank.<N>``, zero-padded to the width of the largest rank as Horovod does (rank.07 of 12)."""
    width = len(str(max(size - 1, 0)))
    return f"rank.{rank:0{width}d}"


class _Stream:
    """One worker pipe being forwarded: where its bytes go and the partial line read so far."""

    __slots__ = ("rank", "kind", "pipe", "fd", "raw_file", "line_filter", "watcher", "prefix",
                 "pending", "done")

    def __init__(self, rank: int, kind: str, pipe: BinaryIO, raw_file: BinaryIO | None,
                 line_filter: Callable[[bytes], bytes] | None, watcher: TracebackWatcher | None) -> None:
        self.rank = rank
        self.kind = kind
        self.pipe = pipe
        self.fd = pipe.fileno()
        self.raw_file = raw_file
        self.line_filter = line_filter
        self.watcher = watcher
        self.prefix = f"[{rank}]<{kind}>:"
        self.pending = bytearray()  # bytes after the last complete line
        self.done = threading.Event()  # set once the pipe reached end of file and all was forwarded

    def take_lines(self, data: bytes) -> list[bytes]:
        """Append ``data``; return the complete lines (and MAX_LINE_BYTES pieces of longer ones)."""
        buf = self.pending
        buf += data
        lines = []
        start = 0
        while True:
            newline = buf.find(b"\n", start, start + MAX_LINE_BYTES)
            if newline >= 0:
                lines.append(bytes(buf[start:newline + 1]))
                start = newline + 1
            elif len(buf) - start >= MAX_LINE_BYTES:
                lines.append(bytes(buf[start:start + MAX_LINE_BYTES]))
                start += MAX_LINE_BYTES
            else:
                break
        del buf[:start]
        return lines


class OutputRouter:
    """Copies prefixed worker lines onto the launcher's stdout/stderr (and optional files).

    One reader thread serves every attached pipe through a selector, whatever the number of ranks:
    a 64-rank job costs the launcher one output thread, not 128. The thread starts with the first
    attached pipe and ends when the last one reached end of file (a later attach starts it again).
    """

    def __init__(
        self,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        output_dir: str | None = None,
        size: int = 1,
        timestamps: bool = False,
    ) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._timestamps = timestamps
        self._watchers: dict[int, TracebackWatcher] = {}
        self._broken: set[str] = set()
        self._output_dir = output_dir
        self._size = size
        self._lock = threading.Lock()  # one line at a time on the launcher's streams
        self._state = threading.Condition()  # guards the fields below
        self._new: list[_Stream] = []  # attached, not yet registered with the reader's selector
        self._open = 0  # attached streams not yet at end of file
        self._reader: threading.Thread | None = None
        self._wake_w: int | None = None

    def _target(self, kind: str) -> TextIO:
        stream = self._streams[kind]
        if stream is not None:
            return stream
        return sys.stdout if kind == "stdout" else sys.stderr

    def prepare_files(self, rank: int) -> dict[str, BinaryIO]:
        """Create ``DIR/rank.<N>/`` and open its stdout/stderr files (empty when no directory)."""
        if not self._output_dir:
            return {}
        directory = os.path.join(self._output_dir, rank_directory_name(rank, self._size))
        os.makedirs(directory, exist_ok=True)
        return {kind: open(os.path.join(directory, kind), "wb") for kind in ("stdout", "stderr")}

    def attach(self, rank: int, stdout_pipe: BinaryIO | None, stderr_pipe: BinaryIO | None,
               files: dict[str, BinaryIO] | None = None,
               stderr_filter: Callable[[bytes], bytes] | None = None) -> dict[str, threading.Event]:
        """Start forwarding one worker's pipes; the events (by stream) are set at end of file.

        ``stderr_filter`` sees each stderr line first and returns what to forward (``b""``: nothing);
        remote ranks use it to take the wrapper's status line out of the output.
        """
        files = files or {}
        watcher = self._watchers[rank] = TracebackWatcher()
        streams = []
        for kind, pipe in (("stdout", stdout_pipe), ("stderr", stderr_pipe)):
            if pipe is None:
                continue
            os.set_blocking(pipe.fileno(), False)
            streams.append(_Stream(rank, kind, pipe, files.get(kind),
                                   stderr_filter if kind == "stderr" else None,
                                   watcher if kind == "stderr" else None))
        with self._state:
            self._new.extend(streams)
            self._open += len(streams)
            if self._reader is None:
                wake_r, self._wake_w = os.pipe()
                self._reader = threading.Thread(target=self._read_all, args=(wake_r,),
                                                name="hora-output", daemon=True)
                self._reader.start()
            else:
                self._wake()
        return {stream.kind: stream.done for stream in streams}

    def _wake(self) -> None:
        wake_w = self._wake_w
        assert wake_w is not None, "called only while the reader runs"
        try:
            os.write(wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full wake pipe already wakes the reader

    def last_exception(self, rank: int) -> str | None:
        """The exception line of the last Python traceback ``rank`` wrote on stderr, if any.

        Complete once the rank's stderr reached end of file (after :meth:`join`).
        """
        watcher = self._watchers.get(rank)
        return watcher.last if watcher is not None else None

    def join(self, timeout: float) -> bool:
        """Wait for every pipe to reach end of file; False if some are still open after ``timeout``."""
        with self._state:
            return self._state.wait_for(lambda: self._open == 0, timeout)

    def _read_all(self, wake_r: int) -> None:
        """The reader thread: forward whatever any pipe has, until every pipe reached end of file."""
        os.set_blocking(wake_r, False)
        selector = selectors.DefaultSelector()
        selector.register(wake_r, selectors.EVENT_READ, None)
        try:
            while True:
                with self._state:
                    for stream in self._new:
                        selector.register(stream.fd, selectors.EVENT_READ, stream)
                    self._new.clear()
                    if self._open == 0:
                        if self._wake_w is not None:  # set while this reader runs
                            os.close(self._wake_w)
                        self._reader = self._wake_w = None
                        return
                for key, _events in selector.select():
                    stream = key.data
                    if stream is None:
                        try:
                            while os.read(wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                        continue
                    if not self._read(stream):
                        selector.unregister(stream.fd)
                        self._finish(stream)
        except BaseException:  # never leave join() waiting on a dead reader
            logger.exception("worker output reader failed")
            with self._state:
                self._open = 0
                if self._wake_w is not None:
                    os.close(self._wake_w)
                self._reader = self._wake_w = None
                self._state.notify_all()
            raise
        finally:
            selector.close()
            os.close(wake_r)

    def _read(self, stream: _Stream) -> bool:
        """Forward the complete lines now readable from ``stream``; False at end of file."""
        try:
            data = os.read(stream.fd, 1 << 16)
        except BlockingIOError:
            return True
        except OSError as exc:  # the pipe broke under us during shutdown
            logger.debug("output of rank %d (%s) ended: %s", stream.rank, stream.kind, exc)
            return False
        if not data:
            return False
        self._forward(stream, stream.take_lines(data))
        return True

    def _finish(self, stream: _Stream) -> None:
        """End of file: forward the last partial line, close the pipe and its file."""
        if stream.pending:
            self._forward(stream, [bytes(stream.pending)])
            stream.pending.clear()
        for handle in (stream.raw_file, stream.pipe):
            if handle is not None:
                try:
                    handle.close()
                except OSError:
                    pass
        stream.done.set()
        with self._state:
            self._open -= 1
            self._state.notify_all()

    def _forward(self, stream: _Stream, lines: list[bytes]) -> None:
        """Write ``lines`` (raw bytes, each a line or a piece of one) with the rank's prefix."""
        if stream.line_filter is not None:
            lines = [kept for kept in map(stream.line_filter, lines) if kept]
        if not lines:
            return
        if stream.raw_file is not None:
            self._write_raw(stream.raw_file, b"".join(lines))
        prefix = stream.prefix
        if self._timestamps:
            prefix = f"{datetime.datetime.now().isoformat(sep=' ', timespec='milliseconds')} {prefix}"
        texts = []
        for chunk in lines:
            text = chunk.decode("utf-8", errors="replace")
            if not text.endswith("\n"):
                text += "\n"  # a final partial line (or a piece of a huge one) still ends a line
            if stream.watcher is not None:
                stream.watcher.feed(text)
            texts.append(prefix + text)
        self._emit(stream.kind, "".join(texts))

    @staticmethod
    def _write_raw(raw_file: BinaryIO, chunk: bytes) -> None:
        try:
            raw_file.write(chunk)
            raw_file.flush()
        except OSError as exc:
            logger.warning("cannot write worker output to %s: %s", getattr(raw_file, "name", "?"), exc)

    def _emit(self, kind: str, line: str) -> None:
        if kind in self._broken:
            return  # keep draining the pipe so the worker never blocks on a full buffer
        stream = self._target(kind)
        with self._lock:
            try:
                try:
                    stream.write(line)
                except UnicodeEncodeError:
                    encoding = getattr(stream, "encoding", None) or "ascii"
                    stream.write(line.encode(encoding, errors="replace").decode(encoding))
                stream.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                # The launcher's own stdout went away (e.g. piped into `head`): stop echoing there.
                self._broken.add(kind)
                logger.debug("launcher %s is gone (%s); dropping further worker %s", kind, exc, kind)
