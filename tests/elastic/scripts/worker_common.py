"""What the test workers in this folder share (they run as scripts, so this folder is on their path)."""

from __future__ import annotations

import json
import os

import hora
from hora import basics


def log(event: str, **fields) -> None:
    """One ``LOG {json}`` line: the event and its fields, with pid, rank, size and gen (the round)."""
    fields.update(event=event, pid=os.getpid(), rank=hora.rank(), size=hora.size(),
                  gen=basics._ctx.runtime.round.generation)
    print("LOG " + json.dumps(fields), flush=True)


def first_to_claim(mark: str) -> bool:
    """Whether this process is the first of the job to get here: it creates the file ``mark``, so an
    injected fault fires once, not again in the worker that replays the step after a reset."""
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
