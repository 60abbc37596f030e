"""hora and MPI: jobs started by ``mpirun``/``srun``, worlds from mpi4py communicators, the MPI
transport and ``hora run --mpi``. MPI itself comes from mpi4py (``pip install "hora[mpi]"``); nothing
here imports it until a job asks for MPI, so importing hora never initialises an MPI library."""

from __future__ import annotations

import importlib.util

from hora.transport import mpi_world as state


def built() -> bool:
    """Whether hora can use MPI here: mpi4py is installed (Horovod's ``mpi_built()``: built with MPI)."""
    return importlib.util.find_spec("mpi4py") is not None


def enabled() -> bool:
    """Whether the running job uses MPI (formed over an MPI communicator, or the MPI transport)."""
    return state.in_use()


def threads_supported() -> bool:
    """Whether the MPI library runs with ``MPI_THREAD_MULTIPLE``, so a script may call mpi4py itself
    while hora's engine thread uses MPI. ValueError when MPI is not in use (Horovod's rule)."""
    if not state.in_use():
        raise ValueError("MPI is not in use by this hora job: it was not formed over MPI and its "
                         "transport is not mpi")
    from mpi4py import MPI

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE
