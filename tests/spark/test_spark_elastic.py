"""hora.spark.run_elastic on a real Spark in local-cluster mode (two executor JVMs on this machine;
the session conftest.py shares with test_spark_cluster.py). Training survives the loss of an
executor: the world re-forms on the other executor from the last commit, and when Spark runs the
lost agent task again on the executor the cluster started in its place, the world grows back.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyspark")

import hora
import hora.spark
from hora.errors import ConfigError, LaunchError


def _train(steps: int, kill_marker: str | None = None, step_seconds: float = 0.02) -> dict[str, Any]:
    """Elastic loop: each step adds the world size (summed ones) to the state and commits."""
    import hora.elastic

    hora.init()
    state = hora.elastic.ObjectState(step=0, total=0.0, log=[])

    @hora.elastic.run
    def loop(state):
        while state.step < steps:
            if (kill_marker is not None and state.step == 10 and hora.rank() == 1 and hora.size() == 2
                    and not os.path.exists(kill_marker)):
                open(kill_marker, "w").close()
                _kill_own_executor()
            reduced = hora.allreduce(np.ones(4), op=hora.Sum, name="grad")
            state.total += float(reduced[0])
            state.log.append((state.step, hora.size(), hora.basics._ctx.runtime.round.generation))
            state.step += 1
            state.commit()
            time.sleep(step_seconds)
        return {"rank": hora.rank(), "size": hora.size(), "log": state.log, "total": state.total}

    return loop(state)


def _kill_own_executor() -> None:
    """SIGKILL this task's executor JVM, as a lost machine would end it."""
    import signal

    pid = os.getpid()
    for _ in range(5):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                os.kill(pid, signal.SIGKILL)
                time.sleep(30)  # the JVM's end takes this worker with it
    raise RuntimeError("the executor JVM was not found among this process's parents")


def _sizes(log: list) -> list[int]:
    sizes: list[int] = []
    for _, size, _ in log:
        if not sizes or sizes[-1] != size:
            sizes.append(size)
    return sizes


def test_run_elastic_trains_and_returns_the_final_world(spark_cluster):
    results = hora.spark.run_elastic(_train, args=(15,), num_proc=2, min_np=1, max_np=2, elastic_timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["total"] == 30.0 for r in results)
    assert all({g for _, _, g in r["log"]} == {0} for r in results)  # one world, never re-formed


def test_a_lost_executor_shrinks_the_world_and_its_replacement_grows_it_back(spark_cluster, tmp_path):
    marker = str(tmp_path / "killed")
    began = time.monotonic()
    results = hora.spark.run_elastic(_train, args=(400, marker), num_proc=2, min_np=1, max_np=2,
                                     elastic_timeout=90, cooldown_range=(1, 2))
    elapsed = time.monotonic() - began
    assert os.path.exists(marker), "no executor was killed"
    log = [tuple(entry) for entry in results[0]["log"]]
    # Every rank ends with the same state: each step once, the total the sum of the committed sizes.
    assert all([tuple(e) for e in r["log"]] == log for r in results)
    assert [step for step, _, _ in log] == list(range(400))
    assert all(r["total"] == sum(size for _, size, _ in log) for r in results)
    # The world re-formed after the loss at step 10: in a world of 1, or at once with the agent Spark
    # ran again on the replacement executor (which of the two comes first is Spark's timing).
    generations = [generation for _, _, generation in log]
    assert generations[10] > generations[0], generations[:12]
    sizes = _sizes(log)
    assert sizes[0] == 2 and set(sizes) <= {1, 2}, sizes
    worlds = sorted({(g, size) for _, size, g in log})
    print(f"\nexecutor lost at step 10: worlds (round, size) {worlds}, final world {len(results)}, "
          f"{elapsed:.1f} s in all; " + "; ".join(f"size {s}: {sum(1 for _, x, _ in log if x == s)} steps"
                                                 for s in sorted(set(sizes))))


def test_too_few_slots_for_min_np_end_within_the_elastic_timeout(spark_cluster):
    began = time.monotonic()
    with pytest.raises(LaunchError, match=r"fewer than 3 usable slot\(s\) for 4 s") as info:
        hora.spark.run_elastic(_train, args=(5,), num_proc=3, min_np=3, max_np=3, elastic_timeout=4)
    assert time.monotonic() - began < 40
    assert "\n" not in str(info.value)


def test_bad_elastic_arguments_are_refused(spark_cluster):
    with pytest.raises(ConfigError, match="give min_num_proc or min_np, not both"):
        hora.spark.run_elastic(_train, num_proc=2, min_num_proc=1, min_np=2)
    with pytest.raises(ConfigError, match="min-np 3 is greater than --max-np 2"):
        hora.spark.run_elastic(_train, num_proc=2, min_np=3, max_np=2)
