"""The yaml extra alone: the worker side of ``hora run --config-file cfg.yaml -np 2``. The launcher
reads the Horovod-schema YAML (PyYAML, the extra's package) and hands its settings to the workers;
each prints what its engine runs with, so the test sees the file's values arrive, not the defaults.
"""

from __future__ import annotations

import numpy as np
from smoke_report import report  # this folder: on the path of a script run from it

import hora
from hora import basics, config


def main() -> None:
    hora.init()
    summed = hora.allreduce(np.array([1.0 + hora.rank(), 10.0]), op=hora.Sum, name="smoke.sum")
    settings = basics.engine().settings
    report({
        "rank": hora.rank(), "size": hora.size(), "sum": summed.tolist(),
        "fusion_threshold": settings.fusion_threshold, "cycle_time_ms": settings.cycle_time_s * 1000,
        "cache_capacity": config.get("cache_capacity"), "timeline_mark_cycles": config.get("timeline_mark_cycles"),
    })
    hora.shutdown()


if __name__ == "__main__":
    main()
