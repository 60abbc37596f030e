#!/usr/bin/env python
"""How long an elastic job takes to recover from a killed worker, and how that grows with the model.

For each model size, one elastic job: ``hora run -np 4 --min-np 2 -H localhost:2,127.0.0.1:2``. The
state is an ``ObjectState`` holding the parameters (float32, ``--mb`` MB) and a step counter; each
step allreduces a gradient the size of the model and commits. At step ``--kill-at`` rank 0 writes the
time and kills itself with SIGKILL. The survivors (the other host's two workers) report when they
saw the failure, when the re-formed world was ready, and when their first step after it finished
(the sync of the state from the new rank 0 comes in between). Printed per size, in seconds:

- ``detect``: kill to the survivors' ``HorovodInternalError``;
- ``reform``: from there to the new world formed (shutdown, driver's new round, init);
- ``resume``: from there to the first finished step (state sync plus one step);
- ``total``: kill to that first step.

With ``--emulated-hosts 2`` the job runs instead on two network-namespace hosts of the emulated
cluster (tests/cluster/emucluster.py; needs root), 2 slots each, links shaped to ``--link-gbit``,
workers started over SSH: rank 0's host fails and the other host's two workers carry on.

    python benchmarks/elastic_recovery.py                 # 1 MB and 100 MB, one machine
    python benchmarks/elastic_recovery.py --mb 1 10 100 --json
    python benchmarks/elastic_recovery.py --emulated-hosts 2 --link-gbit 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

TAG = "ELASTIC_RECOVERY "


def worker(mb: float, steps: int, kill_at: int, mark: str) -> None:
    import numpy as np

    import hora
    import hora.elastic
    from hora.errors import HorovodInternalError

    hora.init()
    elements = max(1, int(mb * 1e6 / 4))
    state = hora.elastic.ObjectState(step=0, params=np.zeros(elements, np.float32))
    times: dict[str, float] = {}
    state.register_reset_callbacks([lambda: times.setdefault("reformed", time.time())])
    grad = np.ones(elements, np.float32)

    @hora.elastic.run
    def train(state: Any) -> None:
        while state.step < steps:
            if state.step == kill_at and hora.rank() == 0 and hora.size() == 4 and not os.path.exists(mark):
                with open(mark, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), 9)
            try:
                state.params += hora.allreduce(grad, name="grad")
            except HorovodInternalError:
                times.setdefault("detected", time.time())
                raise
            state.step += 1
            if "reformed" in times and "resumed" not in times:
                times["resumed"] = time.time()
            state.commit()

    train(state)
    if hora.rank() == 0 and "resumed" in times:
        print(TAG + json.dumps({"mb": mb, "size": hora.size(), **times}), flush=True)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_one(mb: float, steps: int, kill_at: int, timeout: float, hosts: str = "localhost:2,127.0.0.1:2",
            launcher_args: tuple[str, ...] = ()) -> dict[str, float]:
    # The mark file lives in the repository's folder: emulated hosts share this machine's files.
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        mark = os.path.join(tmp, "killed")
        cmd = [sys.executable, "-m", "hora", "run", "-np", "4", "--min-np", "2", "-H", hosts, *launcher_args,
               "--elastic-timeout", "120", sys.executable, os.path.abspath(__file__), "--worker",
               "--mb", str(mb), "--steps", str(steps), "--kill-at", str(kill_at), "--mark", mark]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [line.split(TAG, 1)[1] for line in proc.stdout.splitlines() if TAG in line]
        if proc.returncode != 0 or not lines or not os.path.exists(mark):
            raise SystemExit(f"the {mb} MB job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        seen = json.loads(lines[-1])
        with open(mark) as f:
            killed = float(f.read())
    return {"mb": mb, "detect": seen["detected"] - killed, "reform": seen["reformed"] - seen["detected"],
            "resume": seen["resumed"] - seen["reformed"], "total": seen["resumed"] - killed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, nargs="+", default=[1.0, 100.0], help="model sizes in MB")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--emulated-hosts", type=int, default=0,
                        help="run on this many emulated hosts (2 slots each; needs root)")
    parser.add_argument("--link-gbit", type=float, default=1.0, help="emulated link speed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mark", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.mb[0], args.steps, args.kill_at, args.mark)
        return 0
    if args.emulated_hosts:
        sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
        from emucluster import EmulatedCluster

        with EmulatedCluster(args.emulated_hosts, rate=f"{args.link_gbit * 1000:g}mbit") as cluster:
            launcher = (*cluster.ssh_flags(), "--network-interfaces", cluster.interfaces_flag())
            rows = [run_one(mb, args.steps, args.kill_at, args.timeout, cluster.host_list(2), launcher)
                    for mb in args.mb]
    else:
        rows = [run_one(mb, args.steps, args.kill_at, args.timeout) for mb in args.mb]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'model MB':>9} {'detect s':>9} {'reform s':>9} {'resume s':>9} {'total s':>9}")
    for row in rows:
        print(f"{row['mb']:>9g} {row['detect']:>9.3f} {row['reform']:>9.3f} {row['resume']:>9.3f} {row['total']:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
