"""hora and MPI: jobs started by ``mpirun``/``srun``, worlds from mpi4py communicators, the MPI
transport and ``hora run --mpi``. MPI itself comes from mpi4py (``pip install "hora[mpi]"``); nothing
here imports it until a job asks for MPI, so importing hora never initialises an MPI library."""

from __future__ import annotations

import functools
import importlib.util

from hora.transport import mpi as mpi_transport, mpi_world as state


def built() -> bool:
    """Whether hora can use MPI here (Horovod's ``mpi_built()``: built with MPI): mpi4py imports and
    loads its MPI library, the same test ``hora check`` and ``hora run --mpi`` make. An mpi4py that
    is installed but broken, or finds no MPI library, would otherwise say yes to a script that then
    fails when it asks for MPI. The library is loaded once per process, in a child Python (see
    :func:`hora.transport.mpi.unavailable_reason`)."""
    if importlib.util.find_spec("mpi4py") is None:
        return False
    return _unavailable_reason() is None


@functools.lru_cache(maxsize=1)
def _unavailable_reason() -> str | None:
    return mpi_transport.unavailable_reason()


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
