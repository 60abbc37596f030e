"""``srun -n 2 python ...`` on a real one-node Slurm cluster (slurm_cluster.py): identity from srun's
variables, the world formed through rank 0's rendezvous file (no MPI plugin) or through mpi4py
(``--mpi=pmix``), where the MPI transport then carries the collectives."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm_cluster
from mpi_jobs import ROOT, mpi_env, records

WHY_NOT = slurm_cluster.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

# hora's own allreduce on NumPy arrays: the subject is how srun's ranks form a world, and torch's
# import would cost each rank seconds.
SCRIPT = ("import sys, hora, numpy as np; hora.init(); "
          "s = float(hora.allreduce(np.array([1.0 + hora.rank()]), op=hora.Sum)[0]); "
          "sys.stdout.write(f'RESULT {hora.rank()} {hora.size()} {hora.local_rank()} {hora.mpi_enabled()} {s}\\n')")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.SlurmCluster]:
    running = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield running
    running.stop()


def _srun(cluster: slurm_cluster.SlurmCluster, args: list[str], extra: dict[str, str], tmp: Path) -> str:
    env = mpi_env({**cluster.env(), "HORA_MPI_RENDEZVOUS_DIR": str(tmp), **extra})
    proc = subprocess.run([shutil.which("srun"), "-n", "2", "--overcommit", *args, sys.executable, "-c", SCRIPT],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.timeout(240)
def test_srun_without_an_mpi_plugin_meets_through_rank_0s_rendezvous_file(cluster, tmp_path) -> None:
    out = _srun(cluster, [], {}, tmp_path)
    assert sorted(records(out, "RESULT")) == ["0 2 0 False 3.0", "1 2 1 False 3.0"], out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(240)
def test_srun_with_pmix_forms_the_world_over_mpi4py_and_the_mpi_transport(cluster, tmp_path) -> None:
    out = _srun(cluster, ["--mpi=pmix"], {"HORA_TRANSPORT": "mpi"}, tmp_path)
    assert sorted(records(out, "RESULT")) == ["0 2 0 True 3.0", "1 2 1 True 3.0"], out
