"""Identity from mpirun/mpiexec/srun variables, and the refusals where no world can be formed.

The variable sets are the ones Open MPI 4, MPICH's Hydra and Slurm's srun give each process (Slurm
itself cannot run here: see docs/migrating-from-horovod.md). Jobs started by the real mpirun are in
test_mpi_jobs.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from mpi_jobs import mpi_env

from hora.errors import ConfigError
from hora.workers.launcher_env import detect


def test_open_mpi_variables() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PMIX_NAMESPACE": "1750401025", "PMIX_RANK": "5"}
    me = detect(env)
    assert (me.rank, me.size, me.local_rank, me.local_size, me.cross_rank, me.cross_size) == (5, 8, 1, 4, 1, 2)
    assert me.mpi and me.job_key == "ompi-1750401025" and me.launcher == "Open MPI"


def test_mpich_pmi_variables() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3", "PMI_FD": "7"}
    me = detect(env)
    assert (me.rank, me.size, me.local_rank, me.local_size) == (2, 3, 2, 3)
    assert me.mpi and me.job_key is None  # Hydra names no job: the world needs mpi4py


def test_slurm_srun_variables_as_srun_sets_them() -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "5", "SLURM_NTASKS": "5", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_TASKS_PER_NODE": "2,3"}
    me = detect(env)
    assert (me.rank, me.size, me.local_rank, me.local_size, me.cross_rank, me.cross_size) == (3, 5, 1, 3, 1, 2)
    assert not me.mpi and me.job_key == "slurm-4242.0"
    compressed = {**env, "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "2", "SLURM_PROCID": "4",
                  "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "3"}
    me = detect(compressed)
    assert (me.local_rank, me.local_size, me.cross_rank, me.cross_size) == (0, 1, 2, 3)


def test_slurm_pmix_counts_as_an_mpi_launcher_and_a_batch_script_is_one_process() -> None:
    me = detect({"PMIX_RANK": "1", "PMIX_SIZE": "2", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_LOCALID": "1",
                 "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"})
    assert me.mpi and (me.rank, me.size, me.local_rank) == (1, 2, 1) and me.job_key == "pmi-7.3"
    # srun --mpi=pmix sets PMIX_RANK but no size: the step's task count is the size
    me = detect({"PMIX_RANK": "0", "PMIX_NAMESPACE": "slurm.pmix.5.0", "SLURM_STEP_NUM_TASKS": "2",
                 "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "5", "SLURM_LOCALID": "0"})
    assert (me.rank, me.size, me.variable, me.job_key) == (0, 2, "SLURM_STEP_NUM_TASKS", "pmi-slurm.pmix.5.0")
    # sbatch's own step: SLURM_NTASKS is the allocation's, but no srun started this process
    assert detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}) is None
    assert detect({}) is None


def test_inconsistent_variables_are_refused_naming_them() -> None:
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_SIZE=2 is set but OMPI_COMM_WORLD_RANK is not"):
        detect({"OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="rank 4 but PMI_SIZE=4"):
        detect({"PMI_RANK": "4", "PMI_SIZE": "4"})


def _init_fails(env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", "import hora; hora.init()"], env=mpi_env(env),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, proc.stdout
    return proc.stderr


@pytest.mark.timeout(90)
def test_init_refuses_where_the_ranks_cannot_find_each_other(tmp_path) -> None:
    # a PMI launcher naming no job id, with the file rendezvous forced: nothing can tie the ranks together
    err = _init_fails({"PMI_RANK": "1", "PMI_SIZE": "2", "HORA_MPI_BOOTSTRAP": "file"})
    assert "rank 1 of 2 started by an MPI launcher (PMI) (PMI_SIZE=2)" in err and "mpi4py" in err, err
    # a srun rank whose rank 0 never announces itself: a bounded wait, naming the file and the cure
    err = _init_fails({"SLURM_JOB_ID": "99", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                       "HORA_MPI_RENDEZVOUS_DIR": str(tmp_path), "HORA_START_TIMEOUT": "2"})
    assert "rank 0 did not announce" in err and str(tmp_path / "slurm-99.0.json") in err, err
    assert "HORA_MPI_RENDEZVOUS_DIR" in err, err
