"""The one line each smoke prints per rank, which test_extras_alone.py reads back."""

from __future__ import annotations

import json
import sys


def report(record: dict) -> None:
    """The line in one write: a launcher that tags each write (mpirun --tag-output) would split a
    line printed as text, then newline, around another rank's tag."""
    sys.stdout.write("SMOKE " + json.dumps(record) + "\n")
    sys.stdout.flush()
