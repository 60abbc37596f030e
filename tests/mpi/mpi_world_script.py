"""One mpirun job (4 ranks) that checks what a script started by mpirun, with no hora run, gets.

Printed records (``CHECK name value``) are compared by tests/mpi/test_mpi_jobs.py. The collectives
are hora's own on NumPy arrays: what is checked is how the world forms under mpirun, and importing
torch would cost each rank seconds (torch under mpirun is the MNIST test's subject).
"""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

import hora

world = MPI.COMM_WORLD
me = world.Get_rank()


def total(value: float, **kwargs: object) -> float:
    """A one-element Sum allreduce read back as a float: the form of the values the test compares."""
    return float(hora.allreduce(np.array([value]), op=hora.Sum, **kwargs)[0])


def say(name: str, value: object) -> None:
    sys.stdout.write(f"CHECK {json.dumps({'rank': me, 'name': name, 'value': value})}\n")  # one write: no
    sys.stdout.flush()  # other rank's line can land inside it


# 1. plain init(): identity from mpirun, world formed through mpi4py
hora.init()
say("identity", [hora.rank(), hora.size(), hora.local_rank(), hora.local_size()])
say("flags", [hora.mpi_built(), hora.mpi_enabled(), hora.mpi_threads_supported()])
say("sum", total(float(me + 1)))
# a process set from an MPI communicator: ranks 1 and 3
odd = world.Split(me % 2, me)
sets = [hora.add_process_set(hora.ProcessSet([0, 2])), hora.add_process_set(hora.ProcessSet([1, 3]))]
mine = sets[me % 2]
say("set_from_comm", hora.ProcessSet(odd).ranks)
say("set_sum", total(float(me), process_set=mine))
# Each pair's collective is its own: a pair done first must not shut hora down (which ends it for
# every rank, as in Horovod) while the other pair's is still pending.
hora.barrier()
hora.shutdown()

# 2. init(comm=sub-communicator): each half of the world is a job of 2
half = world.Split(me // 2, me)
hora.init(comm=half)
say("half", [hora.rank(), hora.size(), total(float(me))])
hora.shutdown()

# 3. init(comm=...) on a communicator of 2 of the 4 ranks; the other two are not in it
pair = world.Create_group(world.Get_group().Incl([1, 3]))
if pair != MPI.COMM_NULL:
    hora.init(comm=pair)
    say("pair", [hora.rank(), hora.size(), total(float(me))])
    hora.shutdown()

# 4. init(comm=[list of ranks]) under mpirun: ranks 0 and 2 only
if me in (0, 2):
    hora.init(comm=[0, 2])
    say("list", [hora.rank(), hora.size(), total(float(me))])
    hora.shutdown()
world.Barrier()
say("done", True)
sys.exit(0)
