"""The Chrome-trace timeline (opens in Perfetto and chrome://tracing), written by global rank 0.

One trace "process" per tensor name. The file is valid JSON at every moment: events are appended by
a writer thread that overwrites the closing ``]`` each time, so a job that dies mid-run still leaves
a trace that loads.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)


class Timeline:
    """Collects events from the engine thread and writes them off that thread."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self._pids: dict[str, int] = {}
        # Open "B" spans per (tensor, event name): an "E" with no open "B" (a timeline started while
        # that tensor was already on its way) is dropped, so every span in the file is balanced.
        self._open: dict[tuple[str, str], int] = {}
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._t0 = time.monotonic()
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file = open(path, "wb+")
        self._file.write(b"[\n]\n")
        self._file.flush()
        self._first = True
        self._thread = threading.Thread(target=self._write_loop, name="hora-timeline", daemon=True)
        self._thread.start()

    def _now_us(self) -> int:
        return int((time.monotonic() - self._t0) * 1e6)

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._queue.put({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            self._queue.put({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def is_open(self, name: str, event: str) -> bool:
        """Whether a span ``event`` of tensor ``name`` has begun and not yet ended."""
        return (name, event) in self._open

    def _emit(self, name: str, ph: str, event: str, args: dict[str, Any] | None = None, tid: int = 0) -> None:
        if ph == "B":
            self._open[(name, event)] = self._open.get((name, event), 0) + 1
        elif ph == "E":
            depth = self._open.pop((name, event), 0)
            if depth == 0:
                return
            if depth > 1:
                self._open[(name, event)] = depth - 1
        record = {"name": event, "ph": ph, "ts": self._now_us(), "pid": self._pid(name), "tid": tid}
        if args:
            record["args"] = args
        if ph == "i":
            record["s"] = "p"
        self._queue.put(record)

    # ---- what the engine reports --------------------------------------------------------------

    def negotiate_start(self, name: str, kind: str) -> None:
        self._emit(name, "B", f"NEGOTIATE_{kind}")

    def negotiate_rank_ready(self, name: str, rank: int) -> None:
        self._emit(name, "i", str(rank))

    def negotiate_end(self, name: str, kind: str) -> None:
        self._emit(name, "E", f"NEGOTIATE_{kind}")

    def cached_negotiation(self, name: str, kind: str, since: float, own_rank: int, late: list[int],
                           members: int) -> None:
        """A negotiation the response cache served: ``NEGOTIATE_<kind>`` from ``since`` (this rank's
        submission, a ``time.monotonic()`` reading) to now, this rank marked ready at ``since`` and
        the ``late`` ranks (those that readied cached tensors in the deciding cycle) at its end."""
        if self.is_open(name, f"NEGOTIATE_{kind}"):
            return
        pid = self._pid(name)
        begin = max(0, int((since - self._t0) * 1e6))
        end = max(begin, self._now_us())
        event = f"NEGOTIATE_{kind}"
        self._queue.put({"name": event, "ph": "B", "ts": begin, "pid": pid, "tid": 0,
                         "args": {"cached": True, "late": late, "members": members}})
        self._queue.put({"name": str(own_rank), "ph": "i", "ts": begin, "pid": pid, "tid": 0, "s": "p"})
        for rank in late:
            if rank != own_rank:
                self._queue.put({"name": str(rank), "ph": "i", "ts": end, "pid": pid, "tid": 0, "s": "p"})
        self._queue.put({"name": event, "ph": "E", "ts": end, "pid": pid, "tid": 0})

    def start(self, name: str, kind: str) -> None:
        self._emit(name, "B", kind)

    def activity_start(self, name: str, activity: str) -> None:
        self._emit(name, "B", activity)

    def activity_end(self, name: str, activity: str) -> None:
        self._emit(name, "E", activity)

    def end(self, name: str, kind: str, dtype: str, shape: tuple[int, ...], error: str | None = None) -> None:
        args = {"dtype": dtype, "shape": list(shape)}
        if error:
            args["error"] = error
        self._emit(name, "E", kind, args)

    def cycle(self) -> None:
        if self.mark_cycles:
            self._queue.put({"name": "CYCLE_START", "ph": "i", "s": "g", "ts": self._now_us(), "pid": 0, "tid": 0})

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    # ---- writer -------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        done = False
        while not done:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            records = [b for b in batch if b is not None]
            done = len(records) < len(batch)  # None: close() asked the loop to end
            if records:
                self._append(records)
        self._file.close()

    def _append(self, records: list[dict[str, Any]]) -> None:
        text = ",\n".join(json.dumps(r, separators=(",", ":")) for r in records)
        try:
            self._file.seek(0, os.SEEK_END)
            self._file.seek(self._file.tell() - 2)  # back over "]\n"
            self._file.write((("" if self._first else ",\n") + text + "\n]\n").encode())
            self._file.flush()
            self._first = False
        except OSError as exc:
            logger.warning("timeline %s: cannot write (%s); further events are dropped", self.path, exc)
