"""An elastic worker that trains until the test says stop, for the launcher's scaling and discovery tests.

Each step averages a rank-dependent gradient into numpy weights held in an ObjectState and commits
(a host change interrupts it there). Weights start rank-dependent (1000 * rank + 1), so a worker
that joins a running job shows its own values until the first sync gives it a survivor's. Every
rank stops at the same step, once any rank sees the file STOP_FILE (agreed by an allreduce), or
after MAX_SECONDS (default 90) so that a test that went wrong leaves no worker behind. With
FAULT_STEP=N and FAULT_MARK=path, rank 0 kills itself (SIGKILL) before step N, once: in the worker
that creates the mark file.

``LOG {json}`` lines, each with pid, rank, size and gen (the rendezvous round):
  start  once per process, with the weights before any sync (``w``)
  world  after the first step in each world this process belongs to: ``step``, ``w``
  fault  just before the injected SIGKILL
  done   the end: ``step``, ``w``, ``reason`` (stop-file or deadline)
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from worker_common import first_to_claim, log

import hora
import hora.elastic

STOP_FILE = os.environ["STOP_FILE"]
DEADLINE = time.monotonic() + float(os.environ.get("MAX_SECONDS", "90"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "-1"))


def maybe_fail(step: int) -> None:
    if step != FAULT_STEP or hora.rank() != 0 or not first_to_claim(os.environ["FAULT_MARK"]):
        return
    log("fault", step=step)
    os.kill(os.getpid(), 9)


def main() -> int:
    hora.init()
    state = hora.elastic.ObjectState(step=0, w=np.full(4, 1000.0 * hora.rank() + 1))
    log("start", w=state.w.tolist())
    reason = {}

    @hora.elastic.run
    def train(state) -> None:
        logged_world = False
        while True:
            stop = 1.0 if os.path.exists(STOP_FILE) else 2.0 if time.monotonic() > DEADLINE else 0.0
            agreed = float(hora.allreduce(np.array([stop]), op=hora.Max, name="stop")[0])
            if agreed:
                reason["why"] = "stop-file" if agreed == 1.0 else "deadline"
                return
            maybe_fail(state.step)
            grad = hora.allreduce(np.full(4, hora.rank() + 1.0), op=hora.Average, name="grad")
            state.w = state.w + grad
            state.step += 1
            if not logged_world:
                logged_world = True
                log("world", step=state.step, w=state.w.tolist())
            state.commit()
            time.sleep(STEP_SLEEP)

    train(state)
    log("done", step=state.step, w=state.w.tolist(), reason=reason.get("why"))
    hora.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
