"""How a process learns which job it joins: the identity init() reads (no workers started)."""

from __future__ import annotations

import pytest

from hora.errors import ConfigError, HoraError
from hora.runtime import identity_for_init
from hora.workers import identity

FULL = {"HORA_RANK": "1", "HORA_SIZE": "2", "HORA_LOCAL_RANK": "1", "HORA_LOCAL_SIZE": "2",
        "HORA_CROSS_RANK": "0", "HORA_CROSS_SIZE": "1", "HORA_HOSTNAME": "localhost",
        "HORA_RENDEZVOUS_ADDR": "127.0.0.1", "HORA_RENDEZVOUS_PORT": "1234", "HORA_SECRET": "ab" * 32,
        "HORA_JOB_ID": "job"}


def test_a_script_started_on_its_own_has_no_identity_and_forms_a_private_job():
    assert identity_for_init({}) is None
    assert identity_for_init({"HORA_SIZE": "1"}) is None
    assert not identity.is_worker({})


def test_a_launched_worker_gets_its_whole_identity():
    me = identity_for_init(FULL)
    assert (me.rank, me.size, me.hostname, me.rendezvous_port, me.job_id) == (1, 2, "localhost", 1234, "job")
    assert identity.is_worker(FULL)


def test_horovod_spellings_count_as_the_same_identity():
    env = {k.replace("HORA_", "HOROVOD_") if k in ("HORA_RANK", "HORA_SIZE") else k: v for k, v in FULL.items()}
    assert identity_for_init(env).rank == 1


def test_a_half_set_mpirun_environment_is_refused():
    """Processes mpirun starts join its job (tests/mpi); its size without its rank is no such process."""
    with pytest.raises(HoraError, match="OMPI_COMM_WORLD_SIZE=4 is set but OMPI_COMM_WORLD_RANK is not.*hora run"):
        identity_for_init({"OMPI_COMM_WORLD_SIZE": "4"})


@pytest.mark.parametrize("var", ["PMI_SIZE", "SLURM_NTASKS"])
def test_a_size_alone_of_pmi_or_slurm_is_a_script_on_its_own(var):
    # e.g. `python train.py` run directly inside an sbatch script, without srun: one process
    assert identity_for_init({var: "4"}) is None


def test_a_size_without_a_rendezvous_address_is_refused():
    with pytest.raises(HoraError, match="HORA_SIZE is set but HORA_RENDEZVOUS_ADDR is not"):
        identity_for_init({"HORA_SIZE": "4"})


def test_a_partial_identity_names_every_missing_variable():
    env = dict(FULL)
    del env["HORA_SECRET"], env["HORA_LOCAL_RANK"]
    with pytest.raises(HoraError, match="HORA_LOCAL_RANK, HORA_SECRET are not set"):
        identity_for_init(env)


def test_contradictory_coordinates_are_a_config_error():
    with pytest.raises(ConfigError, match="HORA_RANK=2 but HORA_SIZE=2"):
        identity_for_init({**FULL, "HORA_RANK": "2"})
