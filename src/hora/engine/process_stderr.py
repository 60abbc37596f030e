"""The engine's diagnostics go to the process's own stderr, file descriptor 2.

A stall report is worth something only if someone sees it. Through Python's ``sys.stderr`` it is
swallowed wherever that object is replaced: pytest's capture, a Jupyter kernel, a logging setup or a
framework that redirects it. Horovod writes these reports from C++ straight to the process's stderr,
which is what the terminal, ``hora run``'s relay and a batch system's job log all read. The records
still propagate to Python's logging, so a handler the user installs sees them too.
"""

from __future__ import annotations

import logging
import os


def write_to_process_stderr(text: str) -> None:
    """Write ``text`` whole to file descriptor 2 (``os.write`` may take only part of it); raises OSError."""
    data = text.encode("utf-8", errors="replace")
    while data:
        written = os.write(2, data)
        data = data[written:]


class ProcessStderrHandler(logging.Handler):
    """Writes each record to file descriptor 2 with ``os.write``, whatever ``sys.stderr`` is now."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_to_process_stderr(self.format(record) + "\n")
        except Exception:  # logging's contract: a failing handler reports, never raises
            self.handleError(record)


def send_to_process_stderr(logger: logging.Logger, level: int = logging.WARNING) -> None:
    """Give ``logger`` one handler writing records of ``level`` and above to file descriptor 2."""
    if any(isinstance(handler, ProcessStderrHandler) for handler in logger.handlers):
        return
    handler = ProcessStderrHandler(level)
    handler.setFormatter(logging.Formatter("hora: %(levelname)s: %(message)s"))
    logger.addHandler(handler)
