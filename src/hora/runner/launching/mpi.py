"""``hora run --mpi`` and ``hora.run(use_mpi=True)``: start the workers through ``mpirun``.

hora still serves the job's rendezvous store (a fresh secret per job, as without ``--mpi``) and
passes its address, port, secret and job id to every rank in the environment, forwarded by name
with ``-x`` (Open MPI) or ``-genvlist`` (MPICH's Hydra), so the secret never appears on a command
line. Each rank's place (rank, size, local rank) comes from mpirun's own variables
(:mod:`hora.workers.launcher_env`). The command line follows Horovod's: ``-np``, ``-H host:slots,...``,
``--bind-to none --map-by slot`` (Open MPI), ``--tag-output`` so every line names its rank, and
``--mpi-args`` appended verbatim before the command (``shlex`` splitting), so it can add or
override any of them. mpirun supervises the ranks: when one fails, it ends the job.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hora import config
from hora.errors import ConfigError, LaunchError
from hora.workers.hosts import Host

if TYPE_CHECKING:
    from hora.runner.launching.job import Job

# Variables every rank needs whatever the host: what Python and the libraries are found through.
_FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")


def mpirun_path() -> str:
    """The ``mpirun`` to start (``HORA_MPIRUN`` overrides the one on PATH)."""
    found = config.get("mpirun") or shutil.which("mpirun")
    if not found:
        raise LaunchError("hora run --mpi needs mpirun on PATH (Open MPI: apt-get install openmpi-bin; "
                          "or MPICH), or HORA_MPIRUN naming it")
    return found


def flavour(mpirun: str) -> str:
    """"openmpi" or "mpich" (Hydra, Intel MPI), from ``mpirun --version``."""
    try:
        text = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {mpirun} --version: {exc}") from None
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text.upper() or "Intel" in text or "MPICH" in text.upper():
        return "mpich"
    raise LaunchError(f"{mpirun} is neither Open MPI nor MPICH/Hydra (its --version says {text.strip()[:80]!r})")


def forwarded_names(env: Mapping[str, str]) -> list[str]:
    """The variables mpirun passes to every rank: hora's and Horovod's, and the Python basics."""
    return sorted(k for k in env if k.startswith(("HORA_", "HOROVOD_")) or k in _FORWARDED)


def mpirun_command(hosts: Sequence[Host] | None, np: int, command: Sequence[str], env: Mapping[str, str],
                   mpi_args: str | None = None, output_dir: str | None = None,
                   mpirun: str | None = None, kind: str | None = None) -> list[str]:
    """The mpirun command line that starts ``np`` ranks of ``command`` on ``hosts``."""
    mpirun = mpirun or mpirun_path()
    kind = kind or flavour(mpirun)
    names = forwarded_names(env)
    argv = [mpirun, "-np", str(np)]
    hosts_arg = ",".join(f"{h.name}:{h.slots}" for h in hosts) if hosts else None
    if kind == "openmpi":
        if hosts_arg:
            argv += ["-H", hosts_arg]
        argv += ["--bind-to", "none", "--map-by", "slot", "--tag-output"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if output_dir:
            argv += ["--output-filename", output_dir]
        for name in names:
            argv += ["-x", name]
    else:
        if hosts_arg:
            argv += ["-hosts", hosts_arg]
        argv.append("-prepend-rank")
        if names:
            argv += ["-genvlist", ",".join(names)]
        if output_dir:
            raise LaunchError("--output-filename with --mpi needs Open MPI's mpirun (Hydra has no equivalent)")
    argv += shlex.split(mpi_args or "")
    return argv + [str(part) for part in command]


def run_mpirun(argv: Sequence[str], env: Mapping[str, str], timeout: float | None = None) -> int:
    """Run mpirun to the end; a SIGINT/SIGTERM to this process is passed on (mpirun stops its ranks)."""
    proc = subprocess.Popen(list(argv), env=dict(env))
    previous = {}

    def forward(signum: int, _frame: object) -> None:
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, forward)
            except ValueError:  # not the main thread: mpirun still ends with its ranks
                pass
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise LaunchError(f"mpirun did not finish within {timeout:.0f} s; stopped it") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def job_environment(job_env: Mapping[str, str], extra_env: Mapping[str, str] | None = None,
                    base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What mpirun starts with: the launcher's environment without any per-rank hora identity (mpirun
    gives each rank its own), the knobs, and the job's store address, secret and id."""
    from hora import config
    from hora.runner.launching.worker_env import IDENTITY_KNOBS

    env = dict(os.environ if base is None else base)
    for name in IDENTITY_KNOBS:
        knob = config.knob(name)
        for var in (knob.env, knob.alias):
            if var:
                env.pop(var, None)
    env.update({str(k): str(v) for k, v in (extra_env or {}).items()})
    env.update(job_env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Horovod's --mpi means MPI carries the CPU collectives too; HORA_TRANSPORT set explicitly wins.
    if not config.is_set("transport", env):
        env[config.knob("transport").env] = "mpi"
    return env


def check_transport(extra_env: Mapping[str, str] | None = None, where: str = "--mpi",
                    base: Mapping[str, str] | None = None) -> None:
    """ConfigError, before anything starts, when the job's ranks could not form their world: with
    ``--mpi`` they run on the mpi transport (unless HORA_TRANSPORT says otherwise), and when its mpi4py
    cannot load here, every rank would fail in ``init()`` with the same traceback, interleaved by
    mpirun, and the cause buried in it. Horovod stops its ``--mpi`` in the same place (a ValueError,
    which ConfigError is) when it was built without MPI."""
    from hora import config
    from hora.transport import unavailable_reason

    env = job_environment({}, extra_env, base)
    if str(config.get("transport", env)).lower() != "mpi":
        return
    why = unavailable_reason("mpi")
    if why is not None:
        raise ConfigError(f"{where} runs the collectives on the mpi transport, which cannot run here: {why} "
                          "(or set HORA_TRANSPORT=tcp to start the ranks through mpirun on hora's own "
                          "transport)")


def run_job(job: Job, hosts: Sequence[Host], np: int, command: Sequence[str],
            extra_env: Mapping[str, str] | None = None, mpi_args: str | None = None,
            output_dir: str | None = None, timeout: float | None = None) -> int:
    """Run ``command`` on ``np`` ranks through mpirun, in ``job`` (entered: its store is served);
    mpirun's exit status."""
    import logging

    if job.context is None:
        raise RuntimeError("enter the Job before starting mpirun")
    env = job_environment(job.context.environment(), extra_env)
    argv = mpirun_command(hosts, np, command, env, mpi_args, output_dir)
    logging.getLogger("hora.runner").info("starting the ranks with: %s", shlex.join(argv))
    return run_mpirun(argv, env, timeout)
