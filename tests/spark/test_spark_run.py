"""hora.spark.run on a real Spark in local mode (2 task slots): ranks, results, output, failures and
the start bound. One session for the module; every call is a real barrier-mode Spark job whose tasks
form a hora world through the driver's rendezvous store.
"""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest

pytest.importorskip("pyspark")

import hora
import hora.spark
from hora.errors import ConfigError, LaunchError
from hora.runner.commands.run_args import UnsupportedOption


def _identity() -> dict:
    hora.init()
    total = hora.allreduce(np.array([2.0 ** hora.rank()]), op=hora.Sum, name="sum")
    return {"rank": hora.rank(), "size": hora.size(), "local_rank": hora.local_rank(),
            "local_size": hora.local_size(), "cross_size": hora.cross_size(), "sum": float(total[0])}


def test_run_returns_each_rank_in_rank_order(spark):
    assert hora.spark.run(lambda: (hora.init(), hora.rank())[1], num_proc=2) == [0, 1]


def test_ranks_form_one_host_world_that_reduces(spark):
    results = hora.spark.run(_identity, num_proc=2)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["size"], r["local_size"], r["cross_size"], r["sum"]) == (2, 2, 1, 3.0)
    assert sorted(r["local_rank"] for r in results) == [0, 1]


def test_num_proc_defaults_to_the_task_slots_and_args_kwargs_env_reach_the_tasks(spark):
    def job(scale, offset=0):
        import os

        hora.init()
        return hora.size() * scale + offset, os.environ.get("MY_SETTING")

    assert hora.spark.run(job, args=(10,), kwargs={"offset": 1}, env={"MY_SETTING": "on"}) == [(21, "on")] * 2


def test_worker_output_reaches_the_given_streams_with_rank_prefixes(spark):
    out, err = io.StringIO(), io.StringIO()

    def chatty():
        import sys

        hora.init()
        print(f"hello from {hora.rank()}")
        print("partial", end="")
        print(f"warning on {hora.rank()}", file=sys.stderr)
        return True

    assert hora.spark.run(chatty, num_proc=2, stdout=out, stderr=err) == [True, True]
    lines = out.getvalue().splitlines()
    assert "[0]<stdout>:hello from 0" in lines and "[1]<stdout>:hello from 1" in lines
    assert "[0]<stdout>:partial" in lines  # a last line without newline is not lost
    assert sorted(err.getvalue().splitlines()) == ["[0]<stderr>:warning on 0", "[1]<stderr>:warning on 1"]


def test_a_task_that_raises_fails_the_call_with_its_exception_and_rank(spark):
    def bad():
        hora.init()
        if hora.rank() == 1:
            raise ValueError("bad shard on rank 1")
        hora.allreduce(np.ones(4), name="after")  # rank 0 loses its peer here
        return "unreachable"

    began = time.monotonic()
    with pytest.raises(ValueError, match="bad shard on rank 1") as info:
        hora.spark.run(bad, num_proc=2)
    assert info.value.hora_rank == 1
    assert "raise ValueError" in info.value.hora_remote_traceback
    assert time.monotonic() - began < 60
    # The session is still usable afterwards.
    assert hora.spark.run(lambda: (hora.init(), hora.size())[1], num_proc=2) == [2, 2]


def test_a_function_calling_sys_exit_is_reported_not_fatal_to_spark(spark):
    def leaves():
        import sys

        sys.exit(3)

    with pytest.raises(SystemExit) as info:
        hora.spark.run(leaves, num_proc=1)
    assert info.value.code == 3 and info.value.hora_rank == 0


def test_more_tasks_than_slots_fail_within_start_timeout_naming_the_slots(spark):
    began = time.monotonic()
    with pytest.raises(LaunchError, match=r"Spark started 0 of 3 tasks within start_timeout=3 s; the cluster "
                                          r"has 2 task slot\(s\)") as info:
        hora.spark.run(lambda: 1, num_proc=3, start_timeout=3)
    assert time.monotonic() - began < 45
    assert "\n" not in str(info.value)
    assert hora.spark.run(lambda: 7, num_proc=2) == [7, 7]  # the cancelled job left nothing behind


def test_bad_arguments_are_refused_before_anything_starts(spark):
    with pytest.raises(ConfigError, match="num_proc must be a positive integer"):
        hora.spark.run(lambda: 1, num_proc=0)
    with pytest.raises(ConfigError, match="start_timeout must be positive"):
        hora.spark.run(lambda: 1, num_proc=1, start_timeout=0)
    with pytest.raises(UnsupportedOption, match="use_mpi"):
        hora.spark.run(lambda: 1, num_proc=1, use_mpi=True)
    with pytest.raises(UnsupportedOption, match="mpi_args"):
        hora.spark.run(lambda: 1, num_proc=1, extra_mpi_args="-x FOO")
    lock = threading.Lock()
    with pytest.raises(ConfigError, match="cannot be sent to the tasks"):
        hora.spark.run(lambda: lock.locked(), num_proc=1)


def test_nics_choose_where_workers_listen_and_a_missing_one_is_named(spark):
    assert hora.spark.run(lambda: (hora.init(), hora.size())[1], num_proc=2, nics=["lo"]) == [2, 2]
    with pytest.raises(RuntimeError, match=r"nics=\['nosuchnic0'\]"):
        hora.spark.run(lambda: 1, num_proc=1, nics=["nosuchnic0"])


def test_layout_groups_executors_by_machine_and_ranks_host_by_host():
    from hora.spark.task import layout

    slots = layout(["10.0.0.2:4001", "10.0.0.3:4001", "10.0.0.2:4002", "[fe80::1]:5000"])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.hostname) for s in slots] == [
        (0, 0, 2, 0, "10.0.0.2"), (2, 0, 1, 1, "10.0.0.3"), (1, 1, 2, 0, "10.0.0.2"), (3, 0, 1, 2, "fe80::1")]


def test_spark_run_example_matches_hora_run_accuracy(spark, monkeypatch, capsys):
    """examples/spark/spark_run.py trains the digits model in 2 Spark tasks to the accuracy
    ``hora run -np 2`` reaches with the same seed, epochs and threads (started alongside)."""
    import importlib
    import os
    import re
    import subprocess
    import sys

    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from job_env import clean_env

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    training = ["--epochs", "2", "--seed", "42", "--num-threads", "1", "--log-interval", "1000"]
    baseline = subprocess.Popen(
        [sys.executable, "-m", "hora", "run", "-np", "2", "python", "examples/pytorch_mnist.py", *training],
        cwd=root, env=clean_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        monkeypatch.syspath_prepend(os.path.join(root, "examples", "spark"))
        example = importlib.import_module("spark_run")
        accuracy = 100.0 * example.main(["--num-proc", "2", *training])
        out, _ = baseline.communicate(timeout=110)
    finally:
        if baseline.poll() is None:
            baseline.kill()
            baseline.wait()
        for name in ("spark_run", "pytorch_mnist"):
            sys.modules.pop(name, None)
    assert baseline.returncode == 0, out[-3000:]
    printed = capsys.readouterr().out
    assert re.search(r"hora.spark.run returned: test accuracy [0-9.]+% after 2 epoch\(s\) on 2 Spark task\(s\)",
                     printed), printed
    assert "[0]<stdout>:" in printed  # rank 0's progress came back through the driver
    found = re.search(r"\[0\]<stdout>:Final test accuracy: ([0-9.]+)%", out)
    assert found, out[-3000:]
    expected = float(found.group(1))
    print(f"\ndigits, 2 epochs, 2 workers: hora.spark.run {accuracy:.2f}%, hora run {expected:.2f}%")
    assert expected > 50.0 and abs(accuracy - expected) <= 1.0
