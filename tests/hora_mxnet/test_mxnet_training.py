"""hora.mxnet's DistributedTrainer and DistributedOptimizer on 2 real workers.

For SGD with momentum and for Adam, 2 workers on half batches end exactly where one Gluon Trainer
on the whole batches ends after 20 steps (also with gradient_predivide_factor and num_groups, and
within float16 rounding with fp16 compression), starting from rank 0's broadcast weights. Also:
deferred-initialisation broadcast, a sparse gradient refused on every rank, argument checks.
"""

from __future__ import annotations

import numpy as np
import pytest
from mxnet_job import run_job

pytestmark = pytest.mark.timeout(1200)  # the first test may build the MXNet venv (pip, once per cache)

SIZE = 2


@pytest.fixture(scope="module")
def job():
    return run_job("training", SIZE)


@pytest.mark.parametrize("section", ["sgd_trainer", "adam_trainer", "sgd_optimizer", "adam_optimizer",
                                     "sgd_trainer_predivide_groups", "adam_optimizer_predivide_groups"])
def test_two_workers_match_one_worker_on_the_whole_batch(job, section):
    rank0 = job.get(section, 0)
    for r in range(SIZE):
        got = job.get(section, r)
        for start, start0 in zip(got["start"], rank0["start"]):
            np.testing.assert_array_equal(start, start0)  # broadcast_parameters gave everyone rank 0's weights
        for w, want, start in zip(got["got"], got["expected"], got["start"]):
            assert np.abs(w - start).max() > 1e-3  # training moved the weights
            np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6)


def test_fp16_compression_matches_within_half_precision(job):
    for r in range(SIZE):
        got = job.get("sgd_trainer_fp16", r)
        for w, want, w0 in zip(got["got"], got["expected"], job.get("sgd_trainer_fp16", 0)["got"]):
            np.testing.assert_allclose(w, want, atol=5e-3)
            np.testing.assert_array_equal(w, w0)  # every rank applied the same compressed average


def test_deferred_parameters_are_broadcast_once_initialised(job):
    weights = [job.get("deferred", r) for r in range(SIZE)]
    for w in weights[1:]:
        for a, b in zip(w, weights[0]):
            np.testing.assert_array_equal(a, b)
    assert np.abs(weights[0][0]).max() > 0


def test_sparse_gradient_refused_on_every_rank_and_the_next_collective_works(job):
    for r in range(SIZE):
        got = job.get("sparse_gradient", r)
        assert got["error"].startswith("ValueError") and f"rank {r} on " in got["error"]
        assert "row_sparse" in got["error"] and "embedding" in got["error"]
        np.testing.assert_array_equal(got["after"], [float(SIZE)] * 3)


def test_wrapping_rules(job):
    for r in range(SIZE):
        got = job.get("wrapping", r)
        assert got["unwrapped_warning"]
        assert got["bad_factor"].startswith("ValueError")
        assert got["bad_params"].startswith("ValueError")
        assert got["is_optimizer"]
