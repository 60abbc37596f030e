"""Fixtures every test directory shares.

pytest puts this directory on ``sys.path``, so helper modules here (``sections``, ``job_env``) import by name,
and ``hora.run`` hands that path on to the workers it starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from job_env import is_hora_variable
from lanes import FOLDER_SECONDS, TOP

import hora
from hora import basics


@pytest.fixture
def no_hora_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HORA_*/HOROVOD_* variables: ``hora.init()`` then forms a private size-1 job."""
    for key in list(os.environ):
        if is_hora_variable(key):
            monkeypatch.delenv(key)


@pytest.fixture
def uninitialised(no_hora_env) -> Iterator[None]:
    """hora not initialised in this process when the test starts (as in a fresh process: no
    rendezvous round remembered either), and not left initialised after it, whatever tests ran before."""
    basics.reset()
    assert not hora.is_initialized()
    yield
    basics.reset()


@pytest.fixture(scope="module", autouse=True)
def _no_initialised_hora_across_modules() -> Iterator[None]:
    """A module may keep one in-process job across its tests (starting one costs time), but never
    hands it to the next module."""
    yield
    hora.shutdown()


#: The modules left out of the fast tier (``scripts/test --fast``, ``-m "not slow"``): the slowest ones
#: of a full run's per-test times, which together take over nine tenths of it, so that the fast tier
#: stays within 5 minutes on a 2-core machine. CI runs everything.
SLOW_MODULES = frozenset({
    "adasum/test_adasum_tensorflow.py",
    "adasum/test_adasum_torch.py",
    "bench/test_bench_api.py",
    "bench/test_bench_cli.py",
    "cluster/test_cluster_elastic.py",
    "cluster/test_cluster_ssh_launch.py",
    "deploy/test_deploy_discover.py",
    "deploy/test_deploy_entrypoint.py",
    "docs_site/test_docs_site.py",
    "elastic/test_driver_bad_input.py",
    "elastic/test_driver_faults.py",
    "elastic/test_driver_tensorflow.py",
    "elastic/test_elastic_convergence.py",
    "elastic/test_elastic_run_multiprocess.py",
    "elastic/test_keras_elastic.py",
    "elastic/test_tensorflow_elastic.py",
    "elastic/test_torch_elastic.py",
    "engine/test_autotune.py",
    "engine/test_timeline_report.py",
    "examples/test_elastic_examples.py",
    "examples/test_examples.py",
    "hora_jax/test_jax_collectives.py",
    "hora_jax/test_jax_keras_backend.py",
    "hora_jax/test_jax_optimizer.py",
    "hora_lightning/test_strategy.py",
    "hora_mxnet/test_mxnet_collectives.py",
    "hora_mxnet/test_mxnet_example.py",
    "hora_ray/test_ray_cluster.py",
    "hora_ray/test_ray_elastic.py",
    "hora_ray/test_ray_example.py",
    "hora_ray/test_ray_executor.py",
    "hora_tensorflow/test_keras_torch_backend.py",
    "hora_tensorflow/test_keras_training.py",
    "hora_tensorflow/test_tf_api.py",
    "hora_tensorflow/test_tf_collectives.py",
    "hora_tensorflow/test_tf_grad_buckets.py",
    "hora_tensorflow/test_tf_graph_mode.py",
    "hora_tensorflow/test_tf_v1_and_more.py",
    "hora_tf_keras/test_tf_keras_aggregation.py",
    "hora_tf_keras/test_tf_keras_example.py",
    "hora_tf_keras/test_tf_keras_grad_buckets.py",
    "hora_tf_keras/test_tf_keras_training.py",
    "hora_torch/test_torch_optimizer.py",
    "mpi/test_mpi_jobs.py",
    "mpi/test_mpi_slurm.py",
    "runner/test_runner_launch.py",
    "spark/test_data.py",
    "spark/test_keras_estimator.py",
    "spark/test_lightning_estimator.py",
    "spark/test_spark_elastic.py",
    "spark/test_spark_run.py",
    "spark/test_torch_estimator.py",
    "transport/test_conformance.py",
    "transport/test_hierarchical.py",
    "transport/test_peer_failure.py",
    "transport/test_scaling_transport.py",
    "transport/test_shm_allreduce_into.py",
})


def _folder(item: pytest.Item, tests_dir: str) -> str:
    """The top folder under tests/ that ``item`` lives in ("." for the modules directly in tests/)."""
    relative = os.path.relpath(str(item.path), tests_dir)
    head, _, rest = relative.partition(os.sep)
    return head if rest else TOP


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        relative = os.path.relpath(str(item.path), tests_dir)
        if relative in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    # Longest folder first (tests/lanes.py's figures; a stable sort keeps the order inside each folder), so
    # that a lane ends on its short folders.
    items.sort(key=lambda item: -FOLDER_SECONDS.get(_folder(item, tests_dir), 0))
