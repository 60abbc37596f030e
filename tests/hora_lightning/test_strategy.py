"""hora.lightning.HoraStrategy: Lightning's Trainer, data-parallel over real hora workers.

2 workers (``hora.run(..., np=2)``) must train to the same weights as 1 process on the whole batch
(SGD with momentum, Adam, gradient accumulation, synchronised batch norm), ``sync_dist`` metrics
and the strategy's collectives must combine the ranks, the example must learn the digits under
``hora run -np 2``, and the strategy must stay sane on one process and refuse what it cannot do.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning_jobs as jobs
from job_env import clean_env

import hora

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_TIMEOUT_S = 240
# float32, 20 steps: the 2-worker sums differ from the 1-worker sums only in rounding order.
ATOL, RTOL = 2e-5, 1e-4

pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)


def _baseline(case: str) -> dict[str, np.ndarray]:
    """The 1-process, whole-batch, plain-Lightning run the 2-worker case must reproduce."""
    return jobs.EQUIVALENCE_CASES[case].baseline()["params"]


def _max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("lightning-checkpoints"))


@pytest.fixture(scope="module")
def two_worker_job(checkpoint_dir: str) -> list[dict[str, Any]]:
    """Every 2-worker check of this module, in one job (starting workers is the slow part)."""
    return hora.run(jobs.worker_everything, args=(checkpoint_dir,), np=2, env=clean_env({"OMP_NUM_THREADS": "1"}),
                    start_timeout=JOB_TIMEOUT_S)


@pytest.fixture
def two_worker_runs(two_worker_job: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rank["equivalence"] for rank in two_worker_job]


@pytest.mark.parametrize("case", list(jobs.EQUIVALENCE_CASES))
def test_two_workers_match_one_process_on_the_whole_batch(case: str, two_worker_runs: list[dict[str, Any]],
                                                          no_hora_env: None) -> None:
    rank0, rank1 = (run[case] for run in two_worker_runs)
    assert (rank0["world_size"], rank0["global_rank"]) == (2, 0)
    assert (rank1["world_size"], rank1["global_rank"]) == (2, 1)
    baseline = jobs.EQUIVALENCE_CASES[case].baseline()
    assert rank0["global_step"] == rank1["global_step"] == baseline["global_step"] > 0
    # The replicas started from rank 0's weights (rank 1 built its own from another seed) and took
    # the same averaged steps: they end bitwise equal.
    for name, value in rank0["params"].items():
        np.testing.assert_array_equal(value, rank1["params"][name], err_msg=name)
    expected = baseline["params"]
    spec = jobs.EQUIVALENCE_CASES[case]
    initial = jobs.params_of(jobs.make_module(spec.optimizer, spec.common.get("batch_norm", False)))
    assert _max_difference(expected, initial) > 0.05, "the baseline barely trained; the comparison would be vacuous"
    for name, value in rank0["params"].items():
        np.testing.assert_allclose(value, expected[name], atol=ATOL, rtol=RTOL, err_msg=f"{case}: {name}")


def test_sync_dist_metrics_and_collectives_combine_the_ranks(two_worker_job: list[dict[str, Any]],
                                                            no_hora_env: None) -> None:
    results = [rank["metrics"] for rank in two_worker_job]
    assert [r["rank"] for r in results] == [0, 1] and len({r["pid"] for r in results}) == 2
    for rank, seen in enumerate(results):
        assert seen["world_size"] == 2 and seen["is_global_zero"] == (rank == 0)
        assert seen["sampler"] == {"num_replicas": 2, "rank": rank}
        # Lightning's DistributedSampler split the 10 validation rows between ranks in order...
        assert seen["val_rows"] == list(range(100 + rank, 110, 2))
        metrics = seen["metrics"]
        assert metrics["rank_mean"] == pytest.approx(0.5)       # mean of 0 and 1 over every row
        assert metrics["rank_sum"] == pytest.approx(2 * 1 + 2 * 2)  # 2 steps on each rank, summed
        assert metrics["rank_max"] == pytest.approx(1.0)
        assert metrics["rank_step"] == pytest.approx(0.5)
        assert metrics["own_rank"] == pytest.approx(rank)      # not synced: each rank keeps its own
        assert metrics["val_rows_mean"] == pytest.approx(104.5)  # 104 on rank 0, 105 on rank 1
        assert seen["all_gather"] == [[0, 10], [1, 10]]
        assert seen["broadcast_from_1"] == {"from": 1}
        assert seen["reduce_int_mean"] == pytest.approx(0.5)   # not truncated to 0
        assert seen["reduce_sum"] == pytest.approx(3.0)
        assert seen["reduce_max_op"] == pytest.approx(1.0)
        assert seen["any_true"] is True and seen["all_true"] is False
    # ...and the 12 training rows, shuffled: each row on one rank, 6 per rank.
    rows = [seen["train_rows"] for seen in results]
    assert len(rows[0]) == len(rows[1]) == 6 and sorted(rows[0] + rows[1]) == list(range(12))


def test_a_second_fit_of_the_same_model_reduces_each_gradient_once(two_worker_job: list[dict[str, Any]],
                                                                  no_hora_env: None) -> None:
    results = [rank["refit"] for rank in two_worker_job]
    for name, value in results[0].items():
        np.testing.assert_array_equal(value, results[1][name], err_msg=name)
    # Two fits of one epoch each = one fit of two epochs (the optimizer restarts with the second
    # fit, and a momentum buffer from scratch matters, so compare with that schedule on 1 process).
    jobs.quiet()
    module = jobs.make_module("sgd")
    import torch

    data = jobs.dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=jobs.GLOBAL_BATCH, sampler=sampler)
    for _ in range(2):
        jobs.trainer(max_epochs=1).fit(module, loader)
    expected = jobs.params_of(module)
    for name, value in results[0].items():
        np.testing.assert_allclose(value, expected[name], atol=ATOL, rtol=RTOL, err_msg=name)


def test_resuming_from_a_checkpoint_continues_the_same_training(two_worker_job: list[dict[str, Any]],
                                                               checkpoint_dir: str, no_hora_env: None) -> None:
    results = [rank["resume"] for rank in two_worker_job]
    assert os.path.exists(results[0]["checkpoint"]) and results[0]["checkpoint"].startswith(checkpoint_dir)
    for name, value in results[0]["params"].items():
        np.testing.assert_array_equal(value, results[1]["params"][name], err_msg=name)
    expected = _baseline("adam")  # the same 2 epochs without the interruption
    for name, value in results[0]["params"].items():
        np.testing.assert_allclose(value, expected[name], atol=ATOL, rtol=RTOL, err_msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_outside_hora_run_the_strategy_trains_as_one_process(optimizer: str, uninitialised: None) -> None:
    """No hora run: hora.init() forms a private 1-process job, and the result is plain Lightning's."""
    from hora.lightning import HoraStrategy

    jobs.quiet()
    run = jobs.train(optimizer, HoraStrategy())
    assert (run["world_size"], run["global_rank"]) == (1, 0)
    expected = jobs.train(optimizer)["params"]
    for name, value in run["params"].items():
        np.testing.assert_allclose(value, expected[name], atol=1e-6, rtol=1e-6, err_msg=name)


def test_the_strategy_is_registered_as_hora(uninitialised: None) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import hora.lightning  # noqa: F401 - registers the name
    from hora.lightning import HoraStrategy

    assert "hora" in StrategyRegistry.available_strategies()
    jobs.quiet()
    assert isinstance(jobs.trainer("hora").strategy, HoraStrategy)


def test_several_cpu_devices_per_process_are_refused_with_the_way_out(uninitialised: None) -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from hora.lightning import HoraStrategy

    jobs.quiet()
    with pytest.raises(MisconfigurationException, match=r"one device per process.*hora run -np N.*devices=1"):
        jobs.trainer(HoraStrategy(), devices=2)


def test_a_half_set_launcher_environment_is_refused_when_the_trainer_is_built(
        uninitialised: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """mpirun's size without its rank: not a process mpirun started (those join the job, see tests/mpi)."""
    from hora.errors import HoraError
    from hora.lightning import HoraStrategy

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    jobs.quiet()
    with pytest.raises(HoraError, match=r"OMPI_COMM_WORLD_SIZE=2 is set but OMPI_COMM_WORLD_RANK is not"):
        jobs.trainer(HoraStrategy())


def test_an_unknown_reduce_op_is_refused_by_name(uninitialised: None) -> None:
    import torch

    from hora.lightning import HoraStrategy

    jobs.quiet()
    strategy = jobs.trainer(HoraStrategy()).strategy
    with pytest.raises(ValueError, match=r"unsupported reduce_op 'median'"):
        strategy.reduce(torch.tensor(1.0), reduce_op="median")
    assert strategy.reduce("not a tensor") == "not a tensor"


def test_the_lightning_example_learns_the_digits_on_two_workers() -> None:
    pytest.importorskip("sklearn")
    proc = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", "python", "examples/pytorch_lightning_mnist.py"],
        cwd=ROOT, env=clean_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}), capture_output=True,
        text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    found = re.findall(r"^\[0\]<stdout>:Test accuracy: ([0-9.]+)% on 2 worker\(s\)", proc.stdout, re.M)
    assert len(found) == 1, proc.stdout[-3000:]
    assert float(found[0]) >= 95.0, proc.stdout[-3000:]
    # Only rank 0 reports.
    assert not re.search(r"^\[1\]<stdout>:Test accuracy", proc.stdout, re.M)
