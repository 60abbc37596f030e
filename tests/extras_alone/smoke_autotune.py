"""The autotune extra alone: the worker side of ``hora run -np 2 --autotune`` (options chosen by the
test). It reduces a handful of gradients per step, checking every result while the tuner changes the
fusion threshold, cycle time and response cache under it, until the tuner says it is done.

With more joint samples than the tuner's 4 fixed start points, its Bayesian search proposes the next
setting: scikit-learn's Gaussian process and scipy's normal distribution, the extra's two packages.
"""

from __future__ import annotations

import numpy as np
from smoke_report import report  # this folder: on the path of a script run from it

import hora
from hora import basics

MAX_STEPS = 300


def main() -> None:
    hora.init()
    rank, size = hora.rank(), hora.size()
    tuner = basics.engine().autotuner
    wrong = 0
    steps = 0
    while steps < MAX_STEPS and tuner is not None and tuner.active:
        handles = [hora.allreduce_async(np.full(1000 * (i + 1), float(rank + steps + i), np.float32),
                                        name=f"grad.{i}", op=hora.Sum) for i in range(4)]
        for i, handle in enumerate(handles):
            want = sum(float(r + steps + i) for r in range(size))
            wrong += int(not np.all(hora.synchronize(handle) == want))
        steps += 1
    settings = basics.engine().settings
    report({
        "rank": rank, "size": size, "steps": steps, "wrong": wrong,
        "tuning": tuner is not None, "still_active": bool(tuner is not None and tuner.active),
        "fusion_mb": settings.fusion_threshold / 2**20, "cycle_ms": settings.cycle_time_s * 1000,
    })
    hora.shutdown()


if __name__ == "__main__":
    main()
