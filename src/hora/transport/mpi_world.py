"""The MPI communicator hora's world was formed over, when it was (``mpi_enabled()`` and the MPI
transport read it). Kept apart so that nothing here imports mpi4py: only code that was handed a
communicator, or asked for MPI, ever initialises MPI."""

from __future__ import annotations

from typing import Any

_base_comm: Any = None
_in_use = False


def set_base_comm(comm: Any) -> None:
    """The communicator whose ranks are hora's world ranks (rank i of hora is rank i of it)."""
    global _base_comm
    _base_comm = comm


def base_comm() -> Any:
    return _base_comm


def mark_in_use(in_use: bool) -> None:
    """Whether the current runtime was formed through MPI (the world bootstrapped over mpi4py or
    using the MPI transport): what Horovod's ``mpi_enabled()`` reports."""
    global _in_use
    _in_use = in_use


def in_use() -> bool:
    return _in_use
