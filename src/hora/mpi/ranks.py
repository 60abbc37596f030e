"""hora world ranks of an MPI communicator's members, for ``ProcessSet(mpi_comm)``."""

from __future__ import annotations

from typing import Any

from hora.transport import mpi_world as state


def world_ranks(comm: Any) -> list[int]:
    """The ranks, in hora's world, of ``comm``'s members: their ranks in the communicator hora's
    world was formed over (``init(comm=...)``'s, else ``MPI_COMM_WORLD``). Every member of ``comm``
    gets the same list; a process outside it (``MPI.COMM_NULL``) cannot name it, so, as in Horovod,
    every rank should build the set from a communicator it belongs to or from a rank list."""
    from mpi4py import MPI

    if comm == MPI.COMM_NULL:
        raise ValueError("ProcessSet(MPI.COMM_NULL): this process is not in that communicator; build the "
                         "process set from a list of ranks on processes outside it")
    base = state.base_comm() or MPI.COMM_WORLD
    group, base_group = comm.Get_group(), base.Get_group()
    try:
        translated = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), base_group)
    finally:
        group.Free()
        base_group.Free()
    missing = [i for i, r in enumerate(translated) if r == MPI.UNDEFINED]
    if missing:
        raise ValueError(f"ranks {missing} of the communicator are not in hora's world "
                         f"(the communicator hora.init was given, of size {base.Get_size()})")
    return sorted(int(r) for r in translated)
