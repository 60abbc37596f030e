"""An unhandled exception on one rank of an MPI job ends the whole job.

A Python process that dies of an exception still finalises MPI on its way out (mpi4py's exit hook),
and Open MPI lets the job go on: the other ranks then wait in their next MPI call (a barrier, a
``Split``) for a rank that will never come, until someone kills the job. Horovod leaves it so. hora
aborts the MPI job instead, as ``python -m mpi4py`` does, so mpirun ends every rank and exits with
an error: the traceback is printed first, then one line naming the rank and host, written to file
descriptor 2 so that no replaced ``sys.stderr`` can swallow it. ``HORA_MPI_ABORT_ON_EXCEPTION=0``
keeps MPI's own behaviour.
"""

from __future__ import annotations

import socket
import sys
from types import TracebackType
from typing import Any

from hora import config
from hora.engine.process_stderr import write_to_process_stderr

_installed = False


def install() -> None:
    """Abort the MPI job (``MPI_COMM_WORLD``) when an exception reaches the top of this process;
    installed once per process, by the first runtime formed over an MPI communicator."""
    global _installed
    if _installed or not config.get("mpi_abort_on_exception"):
        return
    _installed = True
    previous = sys.excepthook

    def abort_the_job(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt):  # mpirun forwards ^C to every rank itself
            return
        _abort(f"{kind.__name__}: {value}")

    sys.excepthook = abort_the_job


def _abort(cause: str) -> None:
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover - installed only after MPI formed the world
        return
    mpi: Any = MPI
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop the abort
            pass
    line = (f"hora: MPI rank {mpi.COMM_WORLD.Get_rank()} on {socket.gethostname()} ended with an unhandled exception "
            f"({cause}); aborting the MPI job so that no other rank waits for it "
            f"(HORA_MPI_ABORT_ON_EXCEPTION=0 keeps MPI's default)\n")
    try:
        write_to_process_stderr(line)
    except OSError:
        pass
    mpi.COMM_WORLD.Abort(1)
