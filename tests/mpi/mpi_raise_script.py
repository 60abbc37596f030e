"""A 2-rank job started by mpirun in which rank 1 dies of an unhandled exception.

Usage: python mpi_raise_script.py wait|leave. With ``wait``, rank 0 then waits in an MPI barrier
that rank 1 never reaches: only an abort of the MPI job ends it. With ``leave``, rank 0 shuts hora
down and exits (what the job does when the abort is turned off: no rank is left waiting).
"""

from __future__ import annotations

import sys

from mpi4py import MPI

import hora

hora.init()
if hora.rank() == 1:
    raise ValueError("raised on purpose by rank 1")
if sys.argv[1] == "wait":
    MPI.COMM_WORLD.Barrier()
hora.shutdown()
