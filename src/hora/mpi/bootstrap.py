"""Forming a hora job that ``mpirun``/``srun`` (or an mpi4py communicator) started, not ``hora run``.

hora's world needs a rendezvous store that every rank can reach, and its address and secret. Under
``hora run`` the launcher serves it and passes both in the environment. Here nobody did, so rank 0
of the job serves one in its own process, and announces it to the others in one of two ways:

- **mpi4py** (when it is installed and an MPI launcher started the job, or when ``init(comm=...)``
  gets a communicator): rank 0 of the communicator broadcasts ``(address, port, secret, job id)``
  with ``comm.bcast``. The secret never leaves the MPI job. Hosts are learned with an allgather, so
  the store listens on loopback when every rank shares one host.
- **a rendezvous file** (no mpi4py, ``srun`` without an MPI plugin, or ``HORA_MPI_BOOTSTRAP=file``):
  rank 0 writes ``<dir>/<job key>.json`` (mode 0600, in a 0700 directory, written whole then
  renamed) and the others poll for it; ``dir`` is ``HORA_MPI_RENDEZVOUS_DIR`` (default
  ``~/.hora/rendezvous``) and must be on a file system every host of the job shares (home
  directories are, on most clusters). The job key comes from the launcher (``PMIX_NAMESPACE``,
  ``SLURM_JOB_ID.SLURM_STEP_ID``), so concurrent jobs never meet; a file older than the reading
  process is ignored (a crashed earlier job's leftover), and rank 0 removes it when it exits. A
  well-known port derived from the job id was rejected: the secret would still have to travel, and
  two jobs on one host could collide.

The identity (and rank 0's server) is kept for the process's life, so ``shutdown()`` then
``init()`` joins the next round of the same store, as under ``hora run``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from hora import config
from hora.errors import HoraError
from hora.rendezvous.auth import new_secret
from hora.rendezvous.server import RendezvousServer
from hora.transport import mpi_world as state
from hora.workers.identity import WorkerIdentity
from hora.workers.launcher_env import LauncherIdentity

logger = logging.getLogger("hora")

_servers: list[RendezvousServer] = []  # rank 0's, alive for the process (workers join rounds later)
_by_key: dict[Any, WorkerIdentity] = {}
_FILE_POLL_S = 0.05
# A rendezvous file written this long before the reading process started belongs to another job.
_STALE_SLACK_S = 60.0


def _announce_address(hosts: list[str] | None) -> str:
    """Where rank 0's store listens and the others dial: loopback when every rank is on this host."""
    iface = config.get("iface")
    if iface:
        from hora.workers.remote_bootstrap import resolve_listen_address

        return resolve_listen_address([iface])
    here = socket.gethostname()
    if hosts is not None and all(h == here for h in hosts):
        return "127.0.0.1"
    if hosts:
        from hora.workers.network import route_source_address

        for host in hosts:
            if host != here:
                address = route_source_address(host)
                if address and not address.startswith("127."):
                    return address
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return socket.gethostbyname(here)


def _serve(address: str) -> tuple[str, int, str, str]:
    secret = new_secret()
    server = RendezvousServer(secret, host=address, port=0).start()
    _servers.append(server)
    host, port = server.address
    return host, port, secret, uuid.uuid4().hex


def _identity(rank: int, size: int, local_rank: int, local_size: int, cross_rank: int, cross_size: int,
              contact: tuple[str, int, str, str]) -> WorkerIdentity:
    addr, port, secret, job_id = contact
    return WorkerIdentity(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                          cross_rank=cross_rank, cross_size=cross_size, hostname=socket.gethostname(),
                          rendezvous_addr=addr, rendezvous_port=int(port), secret=secret, job_id=job_id)


def is_mpi_comm(obj: object) -> bool:
    """Whether ``obj`` is an mpi4py communicator (checked without importing mpi4py)."""
    return type(obj).__module__.startswith("mpi4py") and hasattr(obj, "Get_rank") and hasattr(obj, "bcast")


def mpi4py_world() -> Any:
    """mpi4py's ``MPI`` module (initialising MPI), or None when mpi4py or its MPI library is missing."""
    try:
        from mpi4py import MPI
    except Exception as exc:  # ImportError, or a RuntimeError from a missing libmpi
        logger.debug("mpi4py is not usable: %s", exc)
        return None
    return MPI


def identity_from_comm(comm: Any) -> WorkerIdentity:
    """The identity of this process in the hora job whose world is ``comm`` (an mpi4py
    communicator); every member must call it. Rank 0 of ``comm`` serves the store."""
    from mpi4py import MPI

    if comm == MPI.COMM_NULL:
        raise ValueError("init(comm=MPI.COMM_NULL): this process is not in the communicator; only "
                         "its members call hora.init(comm=...)")
    key = ("comm", MPI._handleof(comm))
    if key in _by_key:
        state.set_base_comm(comm)
        return _by_key[key]
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    leaders = sorted({hosts.index(h) for h in hosts})
    cross_rank, cross_size = leaders.index(hosts.index(hosts[rank])), len(leaders)
    contact = _serve(_announce_address(hosts)) if rank == 0 else None
    contact = comm.bcast(contact, root=0)
    if local_rank >= local_size or cross_rank >= cross_size:  # pragma: no cover - MPI's contract
        raise HoraError(f"MPI gave inconsistent coordinates to rank {rank}")
    me = _identity(rank, size, local_rank, local_size, cross_rank, cross_size, contact)
    state.set_base_comm(comm)
    _by_key[key] = me
    return me


def identity_from_launcher(launched: LauncherIdentity) -> WorkerIdentity:
    """The identity of a process that mpirun/mpiexec/srun started, forming the store as the module
    docstring says (mpi4py when it can, else the rendezvous file)."""
    key = ("launcher", launched.job_key, launched.rank)
    if key in _by_key:
        return _by_key[key]
    how = str(config.get("mpi_bootstrap")).lower()
    if how not in ("auto", "mpi4py", "file"):
        raise HoraError(f"{config.knob('mpi_bootstrap').env}={how!r}: use auto, mpi4py or file")
    mpi = mpi4py_world() if how == "mpi4py" or (how == "auto" and launched.mpi) else None
    if how == "mpi4py" and mpi is None:
        raise HoraError(f"{config.knob('mpi_bootstrap').env}=mpi4py but mpi4py (or its MPI library) cannot be "
                        "imported here: pip install mpi4py")
    if mpi is not None:
        world_size = mpi.COMM_WORLD.Get_size()
        if world_size == launched.size:
            me = identity_from_comm(mpi.COMM_WORLD)
            if me.rank != launched.rank:
                raise HoraError(f"{launched.describe()}, but MPI_COMM_WORLD says rank {me.rank}")
            _by_key[key] = me
            return me
        if how == "mpi4py":
            raise HoraError(f"{launched.describe()}, but MPI_COMM_WORLD has {world_size} processes: the MPI "
                            "library was not started by this launcher (srun needs --mpi=pmix or pmi2)")
        logger.info("%s, but MPI_COMM_WORLD has %d processes; using the rendezvous file", launched.describe(),
                    world_size)
    me = _identity_from_file(launched)
    _by_key[key] = me
    return me


def rendezvous_file(job_key: str) -> Path:
    """Where rank 0 of the job ``job_key`` announces its store."""
    base = config.get("mpi_rendezvous_dir") or os.path.join(os.path.expanduser("~"), ".hora", "rendezvous")
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in job_key)
    return Path(base) / f"{safe}.json"


def _process_start_time() -> float:
    try:
        return os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return time.time()


def _identity_from_file(launched: LauncherIdentity) -> WorkerIdentity:
    if launched.job_key is None:
        raise HoraError(f"{launched.describe()}, but this launcher names no job id and mpi4py is not usable, so "
                        "the ranks cannot find each other: pip install mpi4py, or start the job with "
                        "`hora run -np N ...`")
    path = rendezvous_file(launched.job_key)
    contact: tuple[str, int, str, str]
    if launched.rank == 0:
        single_host = launched.local_size == launched.size
        contact = _serve("127.0.0.1" if single_host else _announce_address(None))
        _write_private(path, {"addr": contact[0], "port": contact[1], "secret": contact[2],
                              "job_id": contact[3], "size": launched.size})
        atexit.register(_remove_quietly, path)
    else:
        contact = _wait_for_file(path, launched)
    return _identity(launched.rank, launched.size, launched.local_rank, launched.local_size,
                     launched.cross_rank, launched.cross_size, contact)


def _write_private(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(record, out)
    os.replace(tmp, path)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _wait_for_file(path: Path, launched: LauncherIdentity) -> tuple[str, int, str, str]:
    timeout = float(config.get("start_timeout"))
    not_before = _process_start_time() - _STALE_SLACK_S
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if path.stat().st_mtime >= not_before:
                record = json.loads(path.read_text())
                if int(record["size"]) == launched.size:
                    return str(record["addr"]), int(record["port"]), str(record["secret"]), str(record["job_id"])
        except (OSError, ValueError, KeyError):
            pass  # not written yet, or being replaced
        time.sleep(_FILE_POLL_S)
    raise HoraError(f"{launched.describe()} on {socket.gethostname()}: rank 0 did not announce the job's "
                    f"rendezvous in {path} within {timeout:.0f} s; that directory must be shared by every host "
                    f"of the job (set {config.knob('mpi_rendezvous_dir').env}), or install mpi4py")
