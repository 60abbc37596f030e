"""The images' entrypoint (docker/entrypoint.sh) run directly in emulated hosts, as two containers.

Each namespace host of tests/cluster plays one container: ``entrypoint.sh worker`` starts sshd on
port 2223 with the key from a directory laid out as the chart's Secret is mounted (mode 0600, not
the cluster's own key), the health check passes once sshd listens, and a launcher started through
the entrypoint waits for both workers and runs the 2-worker digits example over SSH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from deploy_helpers import ENTRYPOINT, REPO, start_cluster_or_skip

pytestmark = pytest.mark.timeout(300)

PORT = "2223"  # the cluster's own sshd has 2222


@pytest.fixture(scope="module")
def cluster():
    emulated = start_cluster_or_skip(2)
    try:
        yield emulated
    finally:
        emulated.close()


def container_env(home, secret, **extra):
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), HORA_SSH_SECRET_DIR=str(secret), HORA_SSH_PORT=PORT,
               HORA_SSHD_STRICT_MODES="no",  # the homes are under /tmp (world-writable parents)
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", PYTHONPATH=str(REPO / "src"))
    env.pop("HORA_SSH_COMMAND", None)
    env.update(extra)
    return env


def test_deploy_entrypoint_two_workers_run_the_digits_example_over_ssh(cluster, tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(secret / "id_ed25519")],
                   check=True, timeout=30)
    (secret / "id_ed25519.pub").unlink()
    (secret / "id_ed25519").chmod(0o600)  # the Secret's defaultMode

    # Worker mode without a key fails at once, naming the directory.
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = subprocess.run(cluster.hosts[0].exec_argv([str(ENTRYPOINT), "worker"]), capture_output=True,
                         text=True, timeout=30, env=container_env(tmp_path / "bad", empty))
    assert bad.returncode == 1 and f"no SSH key in {empty}" in bad.stderr, bad.stderr

    workers = []
    try:
        for host in cluster.hosts:
            env = container_env(tmp_path / f"home{host.index}", secret)
            workers.append((host, env, subprocess.Popen(host.exec_argv([str(ENTRYPOINT), "worker"]),
                                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                        text=True, env=env)))
        for host, env, proc in workers:
            deadline = time.monotonic() + 30
            while True:
                health = subprocess.run(host.exec_argv([str(ENTRYPOINT), "health"]), env=env, timeout=30,
                                        capture_output=True, text=True)
                if health.returncode == 0:
                    break
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, health.stderr
                time.sleep(0.3)
            mode = os.stat(tmp_path / f"home{host.index}" / ".hora-ssh" / "id_key").st_mode & 0o777
            assert mode == 0o600

        hosts = ",".join(f"{host.address}:1" for host in cluster.hosts)
        launcher_env = container_env(tmp_path / "launcher", secret, HORA_WAIT_FOR_HOSTS=hosts,
                                     HORA_WAIT_FOR_WORKERS_SECONDS="30")
        argv = [str(ENTRYPOINT), sys.executable, "-m", "hora", "run", "-np", "2", "-H", hosts,
                "--network-interfaces", "hora0", sys.executable, "examples/pytorch_mnist.py", "--epochs", "1"]
        job = subprocess.run(cluster.hosts[0].exec_argv(argv), capture_output=True, text=True, timeout=240,
                             env=launcher_env, cwd=str(REPO))
        assert job.returncode == 0, job.stderr[-3000:]
        assert "Training on 2 worker(s)" in job.stdout, job.stdout[-2000:]
        accuracy = float(re.search(r"Final test accuracy: ([0-9.]+)%", job.stdout).group(1))
        # One epoch on the 8x8 digits (kept short for CI) is well above chance (10%), not converged.
        assert accuracy > 25.0, job.stdout[-2000:]
    finally:
        for _, _, proc in workers:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
