"""hora.spark.run on Spark's local-cluster mode: two executor JVMs of one core each on this machine,
the nearest thing to a cluster that runs here. The tasks of one call run in different executors (so
in unrelated Python processes), and losing an executor mid-run ends the call with a clear error
within a bound instead of letting Spark restart the world.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytest.importorskip("pyspark")

import hora
import hora.spark
from hora.errors import LaunchError


def _where() -> dict:
    from pyspark import TaskContext

    hora.init()
    total = hora.allreduce(np.arange(4.0) * (hora.rank() + 1), op=hora.Sum, name="x")
    return {"rank": hora.rank(), "local_size": hora.local_size(), "executor_pid": os.getppid(),
            "partition": TaskContext.get().partitionId(), "total": total.tolist()}


def test_tasks_in_two_executors_form_one_world(spark_cluster):
    results = hora.spark.run(_where, num_proc=2, start_timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["total"] == [0.0, 3.0, 6.0, 9.0] for r in results)
    assert all(r["local_size"] == 2 for r in results)  # both executors run on this machine


def _kill_my_executor_on_rank_1(marker: str) -> str:
    import signal

    hora.init()
    if hora.rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        # The Python worker's parent chain ends in the executor JVM: end it as a lost machine would.
        os.kill(_executor_jvm_pid(), signal.SIGKILL)
    while True:  # training that only the loss of the executor ends
        hora.allreduce(np.ones(8), name="step")
        time.sleep(0.01)


def _executor_jvm_pid() -> int:
    pid = os.getpid()
    for _ in range(5):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return pid
    raise RuntimeError("the executor JVM was not found among this process's parents")


def test_a_lost_executor_ends_the_call_with_a_clear_error(spark_cluster, tmp_path):
    began = time.monotonic()
    with pytest.raises(LaunchError) as info:
        hora.spark.run(_kill_my_executor_on_rank_1, args=(str(tmp_path / "killed"),), num_proc=2,
                       start_timeout=120)
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert ("Spark restarted the stage" in message or "the Spark job failed" in message), message
    assert elapsed < 150, elapsed
    print(f"\nexecutor lost -> hora.spark.run raised in {elapsed:.1f} s: {message[:300]}")
