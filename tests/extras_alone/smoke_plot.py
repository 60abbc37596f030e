"""The plot extra alone: the worker side of a 2-rank job whose timeline (HOROVOD_TIMELINE, written by
rank 0) the test then renders with ``hora timeline TRACE --plot OUT.png``, the one place hora draws
with matplotlib. Three named tensors, reduced a few times each, give the trace something to chart.
"""

from __future__ import annotations

import numpy as np
from smoke_report import report  # this folder: on the path of a script run from it

import hora

TENSORS = ("smoke.a", "smoke.b", "smoke.c")
STEPS = 4


def main() -> None:
    hora.init()
    rank = hora.rank()
    totals = []
    for step in range(STEPS):
        handles = [hora.allreduce_async(np.full(256 * (i + 1), rank + step + 1.0, np.float32), name=name, op=hora.Sum)
                   for i, name in enumerate(TENSORS)]
        totals.append([float(hora.synchronize(h)[0]) for h in handles])
    report({"rank": rank, "size": hora.size(), "sums": totals})
    hora.shutdown()


if __name__ == "__main__":
    main()
