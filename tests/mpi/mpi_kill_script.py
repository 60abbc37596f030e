"""A 3-rank job started by mpirun in which rank 2 is SIGKILLed mid-training.

The survivors keep allreducing; each writes what it saw to ``<out>/rank<N>.json`` the moment its
collective fails (by default mpirun kills the whole job soon after a rank dies, so stdout may be lost
and a survivor may be killed before it gets there; under ``--enable-recovery`` it is not).
Usage: python mpi_kill_script.py OUT_DIR

The collectives are hora's own on NumPy arrays (the framework bindings raise the same
HorovodInternalError from the same engine): no rank pays seconds to import torch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import hora

out = sys.argv[1]
hora.init()
me = hora.rank()
step = 0
try:
    while True:
        step += 1
        if me == 2 and step == 20:
            with open(os.path.join(out, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        hora.allreduce(np.ones(1000, dtype=np.float32), name=f"grad.{step}")
except Exception as exc:  # what a survivor sees is the test's subject
    record = {"type": type(exc).__name__, "is_internal": isinstance(exc, hora.HorovodInternalError),
              "message": str(exc), "at": time.time(), "step": step}
    with open(os.path.join(out, f"rank{me}.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(out, f"rank{me}.json.tmp"), os.path.join(out, f"rank{me}.json"))
    # Not sys.exit: under --enable-recovery mpirun lets survivors run on, and mpi4py's MPI_Finalize at
    # exit would wait for the dead rank forever.
    # Stay a moment first: rank 0's process serves the job's store, and a survivor that left at once
    # would look, to a slower survivor, like a second dead rank.
    time.sleep(3)
    os._exit(1)
