"""Multi-host ``hora run`` over real OpenSSH, on emulated hosts (network namespaces with sshd).

Unless a test says otherwise the launcher runs in the root namespace, a third machine like a login
node, so every rank goes through the SSH path: ssh client, remote sshd, the stdin bootstrap.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from cluster_helpers import (
    JOB,
    REPO,
    assert_no_job_processes,
    hora_run_argv,
    job_processes,
    netns_of,
    processes_matching,
    wait_until,
)
from emucluster import SUBNET

pytestmark = pytest.mark.timeout(90)


def _results(out, size):
    return [json.loads((out / f"rank.{rank}.json").read_text()) for rank in range(size)]


def _check_layout(cluster, out, stdout, interfaces=True):
    h1, h2 = cluster.hosts[:2]
    results = _results(out, 4)
    for result in results:
        assert result["seen"] == result["expect"], result
        assert result["sum_ok"], result
    where = results[0]["where"]
    assert [w["host"] for w in where] == [h1.address] * 2 + [h2.address] * 2
    # --network-interfaces hora0,<bridge> resolved on each host to that host's own address;
    # without it the transport finds its address itself (the route toward the rendezvous store).
    ifaces = [h1.address] * 2 + [h2.address] * 2 if interfaces else [None] * 4
    assert [w["iface"] for w in where] == ifaces
    netns = [w["netns"] for w in where]
    assert netns[0] == netns[1] == netns_of(h1.sshd.pid)
    assert netns[2] == netns[3] == netns_of(h2.sshd.pid)
    assert netns[0] != netns[2]
    assert {w["cwd"] for w in where} == {str(REPO)}  # the launcher's working directory
    assert f"[0]<stdout>:hosts: {h1.address} {h1.address} {h2.address} {h2.address}" in stdout


def _ready(out, size):
    files = [out / f"ready.{rank}.json" for rank in range(size)]
    wait_until(lambda: all(f.exists() for f in files), 45, "every rank to be ready")
    return [json.loads(f.read_text()) for f in files]


def _kill_and_expect_failure(proc, victims, job_id, fragment):
    """SIGKILL ``victims``: the whole job must fail within seconds, its last line containing
    ``fragment`` (the host), and leave no process behind on any host."""
    started = time.monotonic()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    final = [line for line in err.splitlines() if line.startswith("hora run: rank ")]
    assert final and fragment in final[-1], err
    assert elapsed < 10, f"the job took {elapsed:.1f} s to fail"
    assert_no_job_processes(job_id)


def test_cluster_2hosts_x2_ranks_over_ssh_world_size_4(cluster, launcher, tmp_path):
    argv = hora_run_argv(cluster, 4, cluster.host_list(2, count=2), JOB, "check", str(tmp_path))
    proc = launcher(argv)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    _check_layout(cluster, tmp_path, out)


def test_cluster_launcher_on_h1_runs_h1_locally_and_h2_over_ssh_world_size_4(cluster, launcher, tmp_path):
    """The launcher on h1 (no --network-interfaces: addresses come from the routing table)."""
    h1 = cluster.hosts[0]
    argv = hora_run_argv(cluster, 4, cluster.host_list(2, count=2), JOB, "check", str(tmp_path),
                         interfaces=False, extra=("--verbose",))
    proc = launcher(h1.exec_argv(argv))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    _check_layout(cluster, tmp_path, out, interfaces=False)
    assert f"rendezvous store on {h1.address} (the route toward {cluster.hosts[1].address})" in err
    assert f"reached {cluster.hosts[1].address} over SSH" in err  # only h2 is remote
    assert f"started rank 0 on {h1.address} (pid " in err
    assert f"started rank 2 on {cluster.hosts[1].address} (ssh " in err


def test_cluster_unreachable_host_is_named_before_anything_starts_world_size_2(cluster, launcher, tmp_path):
    missing = f"{SUBNET}.{cluster.slot}.99"  # in the emulated subnet, but no host answers there
    argv = hora_run_argv(cluster, 2, f"{cluster.hosts[0].address}:1,{missing}:1", JOB, "loop", str(tmp_path))
    proc = launcher(argv)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"hora run: error: cannot reach host {missing} over SSH" in err
    assert f"ssh: connect to host {missing} port {cluster.ssh_port}" in err  # ssh's own line
    assert cluster.hosts[0].address not in err.split("over SSH", 1)[0]  # only the bad host is named
    assert out == ""
    assert not list(tmp_path.iterdir())
    assert not processes_matching(str(tmp_path))  # no rank was started on the reachable host


def test_cluster_killing_one_hosts_workers_fails_the_job_world_size_4(cluster, launcher, tmp_path):
    h1, h2 = cluster.hosts[:2]
    proc = launcher(hora_run_argv(cluster, 4, cluster.host_list(2, count=2), JOB, "loop", str(tmp_path)))
    ready = _ready(tmp_path, 4)
    job_id, secret = ready[0]["job_id"], ready[0]["secret"]

    # The secret is on no command line, and not in the environment of the ssh clients or wrappers.
    everything = processes_matching("")
    assert not [cmd for cmd in everything.values() if secret in cmd]
    tagged = processes_matching(f"job={job_id}")
    ssh_clients = [pid for pid, cmd in tagged.items() if cmd.startswith("ssh ")]
    wrappers = [pid for pid, cmd in tagged.items() if not cmd.startswith("ssh ")]
    assert len(ssh_clients) == 4 and len(wrappers) == 4, tagged
    for pid in [*wrappers, *ssh_clients]:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            assert secret.encode() not in handle.read()

    h2_netns = netns_of(h2.sshd.pid)
    victims = [pid for pid, cmd in job_processes(job_id).items()
               if "cluster_job.py" in cmd and netns_of(pid) == h2_netns]
    assert len(victims) == 2
    _kill_and_expect_failure(proc, victims, job_id, f"on {h2.address} was killed by signal SIGKILL (9)")


def test_cluster_killing_one_hosts_sshd_sessions_fails_the_job_world_size_4(cluster, launcher, tmp_path):
    h2 = cluster.hosts[1]
    proc = launcher(hora_run_argv(cluster, 4, cluster.host_list(2, count=2), JOB, "loop", str(tmp_path)))
    job_id = _ready(tmp_path, 4)[0]["job_id"]
    sessions = [pid for pid in h2.pids()
                if pid != h2.sshd.pid and _cmdline(pid).startswith("sshd:")]
    assert sessions, "no sshd session processes found on h2"
    _kill_and_expect_failure(proc, sessions, job_id, f"on {h2.address} lost its SSH connection")


def test_cluster_killed_launcher_leaves_no_remote_workers_world_size_4(cluster, launcher, tmp_path):
    proc = launcher(hora_run_argv(cluster, 4, cluster.host_list(2, count=2), JOB, "loop", str(tmp_path)))
    job_id = _ready(tmp_path, 4)[0]["job_id"]
    assert len(job_processes(job_id)) >= 8  # 4 wrappers and 4 workers
    proc.kill()  # SIGKILL: no chance to clean up; PDEATHSIG takes the ssh clients with it
    proc.communicate(timeout=30)
    assert_no_job_processes(job_id)


def test_cluster_hora_run_api_over_ssh_world_size_2(cluster):
    import hora

    def where():
        return os.environ["HORA_HOSTNAME"], os.stat("/proc/self/ns/net").st_ino

    h1, h2 = cluster.hosts[:2]
    results = hora.run(where, np=2, hosts=f"{h1.address}:1,{h2.address}:1", ssh_port=cluster.ssh_port,
                       ssh_identity_file=cluster.identity_file,
                       network_interface=cluster.interfaces_flag())
    assert results == [(h1.address, netns_of(h1.sshd.pid)), (h2.address, netns_of(h2.sshd.pid))]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
