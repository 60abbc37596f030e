"""The mpi extra alone: ``hora run --mpi -np 2`` starts this through Open MPI's mpirun and plain
``import hora`` (NumPy) reduces over the mpi transport that mpi4py gives it.

``mpi_enabled`` is what proves mpi4py did the work: without it the ranks would still meet (through
a rendezvous file) and the sum would still be right.
"""

from __future__ import annotations

import numpy as np
from smoke_report import report  # this folder: on the path of a script run from it

import hora


def main() -> None:
    hora.init()
    rank = hora.rank()
    summed = hora.allreduce(np.array([1.0 + rank, 10.0]), op=hora.Sum, name="smoke.sum")
    averaged = hora.allreduce(np.arange(4, dtype=np.float32) * (rank + 1), name="smoke.avg")
    report({
        "rank": rank, "size": hora.size(), "sum": summed.tolist(), "average": averaged.tolist(),
        "mpi_enabled": hora.mpi_enabled(), "mpi_built": hora.mpi_built(),
    })
    hora.shutdown()


if __name__ == "__main__":
    main()
