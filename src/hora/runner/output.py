"""Forwarding workers' output to the launcher, one whole line at a time.

Every worker's stdout and stderr are pipes read by a thread each. A complete line is written to the
launcher's stream with Horovod's prefix (``[3]<stdout>:``) and flushed under one lock shared by all
ranks and both streams, so lines from different ranks never interleave mid-line. Bytes are decoded
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
import sys
import threading
import time
from typing import BinaryIO, Callable, TextIO

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


class OutputRouter:
    """Copies prefixed worker lines onto the launcher's stdout/stderr (and optional files)."""

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
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

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
               stderr_filter: Callable[[bytes], bytes] | None = None) -> dict[str, threading.Thread]:
        """Start forwarding one worker's pipes; the threads (returned by stream) end at end of file.

        ``stderr_filter`` sees each stderr line first and returns what to forward (``b""``: nothing);
        remote ranks use it to take the wrapper's status line out of the output.
        """
        files = files or {}
        self._watchers[rank] = TracebackWatcher()
        started: dict[str, threading.Thread] = {}
        for kind, pipe in (("stdout", stdout_pipe), ("stderr", stderr_pipe)):
            if pipe is None:
                continue
            line_filter = stderr_filter if kind == "stderr" else None
            thread = threading.Thread(
                target=self._pump, args=(rank, kind, pipe, files.get(kind), line_filter),
                name=f"hora-output-{rank}-{kind}", daemon=True,
            )
            thread.start()
            self._threads.append(thread)
            started[kind] = thread
        return started

    def last_exception(self, rank: int) -> str | None:
        """The exception line of the last Python traceback ``rank`` wrote on stderr, if any.

        Complete once the rank's stderr reached end of file (after :meth:`join`).
        """
        watcher = self._watchers.get(rank)
        return watcher.last if watcher is not None else None

    def join(self, timeout: float) -> bool:
        """Wait for every pipe to reach end of file; False if some are still open after ``timeout``."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def _pump(self, rank: int, kind: str, pipe: BinaryIO, raw_file: BinaryIO | None,
              line_filter: Callable[[bytes], bytes] | None = None) -> None:
        prefix = f"[{rank}]<{kind}>:"
        watcher = self._watchers.get(rank) if kind == "stderr" else None
        timestamps = self._timestamps
        try:
            while True:
                chunk = pipe.readline(MAX_LINE_BYTES)
                if not chunk:
                    break
                if line_filter is not None:
                    chunk = line_filter(chunk)
                    if not chunk:
                        continue
                if raw_file is not None:
                    self._write_raw(raw_file, chunk)
                text = chunk.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    text += "\n"  # a final partial line (or a piece of a huge one) still ends a line
                if watcher is not None:
                    watcher.feed(text)
                if timestamps:
                    self._emit(kind, f"{datetime.datetime.now().isoformat(sep=' ', timespec='milliseconds')} "
                                     f"{prefix}{text}")
                else:
                    self._emit(kind, prefix + text)
        except (OSError, ValueError) as exc:  # pipe closed under us during shutdown
            logger.debug("output of rank %d (%s) ended: %s", rank, kind, exc)
        finally:
            if raw_file is not None:
                try:
                    raw_file.close()
                except OSError:
                    pass
            try:
                pipe.close()
            except OSError:
                pass

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
