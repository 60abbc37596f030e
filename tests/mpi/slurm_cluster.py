"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd in the foreground, as root,
with a minimal slurm.conf in a temporary directory (Debian's slurmctld/slurmd/slurm-client/munge).

Everything (key, sockets, state, spool, ports) lives in that directory, so it touches no system
configuration and two runs never meet. :func:`start` returns None with the reason when Slurm is not
installed or the process is not root (slurmd must start job steps as any user).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    missing = [name for name in DAEMONS if _tool(name) is None]
    if missing:
        return (f"Slurm/munge not installed ({', '.join(missing)} missing: "
                "apt-get install slurmctld slurmd slurm-client)")
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps"
    return None


def start(root: Path, timeout: float = 60.0) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``root``; wait until the node is idle."""
    host = socket.gethostname()
    for sub in ("state", "spool", "log", "run", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key, sock = root / "munge" / "munge.key", root / "munge" / "munge.socket"
    subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=hora
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    cluster = SlurmCluster(root, conf)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        log = lambda name: open(root / "log" / f"{name}.txt", "w")  # noqa: E731
        cluster.procs.append(subprocess.Popen(
            [_tool("munged"), "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/log/munged.log",
             f"--seed-file={root}/munge/seed"], stdout=log("munged"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        for daemon in ("slurmctld", "slurmd"):
            cluster.procs.append(subprocess.Popen([_tool(daemon), "-D", "-f", str(conf)], env=env,
                                                  stdout=log(daemon), stderr=subprocess.STDOUT))
            time.sleep(1.0)
        while time.monotonic() < deadline:
            state = subprocess.run([_tool("sinfo"), "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            if state.stdout.strip() in ("idle", "mix", "alloc"):
                return cluster
            if any(p.poll() is not None for p in cluster.procs):
                break
            time.sleep(0.5)
        logs = "\n".join(f"{p.name}: {p.read_text()[-800:]}" for p in (root / "log").iterdir())
        raise RuntimeError(f"the Slurm node did not come up within {timeout:.0f} s:\n{logs}")
    except BaseException:
        cluster.stop()
        raise
