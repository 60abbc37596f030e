"""Who a process is when ``mpirun``, MPICH's ``mpiexec`` or Slurm's ``srun`` started it.

Those launchers give each process its rank and the job's size through their own variables, not
hora's. This module reads them (and nothing else), so ``hora.init()`` in a script started by
``mpirun -np 4 python train.py`` knows it is one of four before it has any rendezvous to ask:

- Open MPI: ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``, job key from
  ``PMIX_NAMESPACE`` (unique per ``mpirun``), else ``OMPI_MCA_ess_base_jobid``;
- MPICH, Intel MPI and other PMI launchers (Slurm's ``--mpi=pmi2``/``pmix`` too): ``PMI_RANK``/
  ``PMI_SIZE`` or ``PMIX_RANK``, local ones from ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``;
- Slurm (``srun`` with no MPI plugin): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or
  ``SLURM_NTASKS``), ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_NODEID``, job key
  ``SLURM_JOB_ID.SLURM_STEP_ID``. Only a job *step* counts (``SLURM_STEP_ID`` set): a batch script
  that runs ``python train.py`` itself is one process, whatever ``SLURM_NTASKS`` the allocation has.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from hora.errors import ConfigError
from hora.workers.hosts import SlotInfo


@dataclass(frozen=True)
class LauncherIdentity(SlotInfo):
    """A process's place in a job another launcher started (rank, size, local and cross coordinates,
    hostname); ``job_key`` names the job (None when the launcher gives no job id), ``mpi`` says
    whether an MPI library can form its world."""

    launcher: str
    job_key: str | None
    mpi: bool
    variable: str  # the variable the size came from, for messages

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size} started by {self.launcher} ({self.variable}={self.size})"


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    return None


def _tasks_per_node(spec: str, node: int) -> int | None:
    """Slurm's compressed ``2(x3),1`` list: the task count of node ``node``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node] if 0 <= node < len(counts) else None


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    """Tasks on this node of a Slurm step (None outside one)."""
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not per_node:
        return None
    return _tasks_per_node(per_node, _int(env, "SLURM_NODEID") or 0)


def _finish(launcher: str, variable: str, rank: int, size: int, local_rank: int | None,
            local_size: int | None, node: int | None, nodes: int | None, job_key: str | None,
            mpi: bool) -> LauncherIdentity:
    if not 0 <= rank < size:
        raise ConfigError(f"{launcher} says rank {rank} but {variable}={size}")
    if local_rank is None or local_size is None or not 0 <= local_rank < local_size:
        local_rank, local_size = 0, 1  # unknown: hora finds who shares a host from the connections
    if node is None or nodes is None or not 0 <= node < nodes:
        nodes = max(1, size // local_size)
        node = min(rank // local_size, nodes - 1)
    return LauncherIdentity(rank=rank, size=size, local_rank=local_rank, local_size=local_size, cross_rank=node,
                            cross_size=nodes, hostname=socket.gethostname(), launcher=launcher, job_key=job_key,
                            mpi=mpi, variable=variable)


def detect(environ: Mapping[str, str] | None = None) -> LauncherIdentity | None:
    """This process's identity from mpirun/mpiexec/srun variables; None when none started it."""
    env = os.environ if environ is None else environ
    size = _int(env, "OMPI_COMM_WORLD_SIZE")
    if size is not None:
        rank = _int(env, "OMPI_COMM_WORLD_RANK")
        if rank is None:
            raise ConfigError(f"OMPI_COMM_WORLD_SIZE={size} is set but OMPI_COMM_WORLD_RANK is not: this process "
                              "was not started by mpirun; start workers with mpirun or `hora run`")
        key = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or env.get("OMPI_MCA_orte_ess_jobid")
        return _finish("Open MPI", "OMPI_COMM_WORLD_SIZE", rank, size,
                       _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                       _int(env, "OMPI_COMM_WORLD_NODE_ID"), None, key and f"ompi-{key}", True)
    size = _int(env, "PMI_SIZE", "PMIX_SIZE")
    rank = _int(env, "PMI_RANK", "PMIX_RANK")
    if size is None and "PMIX_RANK" in env:  # srun --mpi=pmix names no size in the environment
        size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if size is not None and rank is not None:
        key = env.get("PMIX_NAMESPACE") or env.get("PMI_KVSNAME") or (
            f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}" if "SLURM_JOB_ID" in env else None)
        variable = next(v for v in ("PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if v in env)
        return _finish("an MPI launcher (PMI)", variable, rank, size,
                       _int(env, "MPI_LOCALRANKID", "SLURM_LOCALID"),
                       _int(env, "MPI_LOCALNRANKS") or _slurm_local_size(env),
                       _int(env, "SLURM_NODEID"), _int(env, "SLURM_STEP_NUM_NODES"), key and f"pmi-{key}", True)
    if env.get("SLURM_STEP_ID", env.get("SLURM_STEPID")) is not None and "SLURM_PROCID" in env:
        variable = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        size = _int(env, variable)
        rank = _int(env, "SLURM_PROCID")
        if size is None or rank is None:
            return None
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
        return _finish("Slurm (srun)", variable, rank, size, _int(env, "SLURM_LOCALID"), _slurm_local_size(env),
                       _int(env, "SLURM_NODEID"), _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES"),
                       f"slurm-{env.get('SLURM_JOB_ID', env.get('SLURM_JOBID', 'job'))}.{step}", False)
    return None
