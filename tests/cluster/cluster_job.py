"""The worker the cluster tests launch on emulated hosts.

``check OUT``: init, check this rank's coordinates against the launcher's layout, allreduce, and
allgather where every rank runs (its -H host name, its network namespace, the address it listens
on); each rank writes what it saw to ``OUT/rank.<N>.json``.

``loop OUT``: init, write ``OUT/ready.<N>.json`` (pid, job id, secret), then allreduce until ``OUT/stop``
exists or a peer fails (exit 3 naming the error).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import hora


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def check(out: Path) -> int:
    hora.init()
    rank, size = hora.rank(), hora.size()
    local_size = int(os.environ["HORA_LOCAL_SIZE"])
    expect = {"local_rank": rank % local_size, "cross_rank": rank // local_size,
              "local_size": local_size, "cross_size": size // local_size}
    seen = {"local_rank": hora.local_rank(), "cross_rank": hora.cross_rank(),
            "local_size": hora.local_size(), "cross_size": hora.cross_size()}
    total = hora.allreduce(np.full(1024, rank, dtype=np.float32), op=hora.Sum, name="ranks")
    where = hora.allgather_object({
        "rank": rank,
        "host": os.environ.get("HORA_HOSTNAME"),
        "netns": os.stat("/proc/self/ns/net").st_ino,
        "iface": os.environ.get("HORA_IFACE"),
        "cwd": os.getcwd(),
    })
    _write(out / f"rank.{rank}.json", {
        "rank": rank, "size": size, "expect": expect, "seen": seen,
        "sum_ok": bool(np.all(total == size * (size - 1) / 2)), "where": where,
    })
    hora.shutdown()
    if rank == 0:
        print("hosts:", " ".join(str(w["host"]) for w in where))
    return 0


def loop(out: Path) -> int:
    hora.init()
    rank = hora.rank()
    # The secret goes to the test (a private temp dir) so it can check that no command line shows it.
    _write(out / f"ready.{rank}.json", {"rank": rank, "pid": os.getpid(),
                                        "job_id": os.environ["HORA_JOB_ID"],
                                        "secret": os.environ["HORA_SECRET"]})
    data = np.ones(4096, dtype=np.float32)
    step = 0
    try:
        while not (out / "stop").exists():
            hora.allreduce(data, op=hora.Sum, name=f"step.{step % 2}")
            step += 1
            time.sleep(0.01)  # pacing only: keeps two cores free for the emulated hosts
    except Exception as exc:  # the point is to report a peer's failure and exit
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 3
    hora.shutdown()
    return 0


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    sys.exit({"check": check, "loop": loop}[mode](out_dir))
