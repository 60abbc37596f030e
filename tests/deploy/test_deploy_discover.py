"""``hora discover kubernetes`` on real DNS names, and an elastic job driven by the chart's script.

The names are served the way a pod's resolver sees them: the launcher runs inside an emulated host
(a network namespace of tests/cluster) whose /etc/hosts (``/etc/netns/NS/hosts``, which ``ip netns
exec`` mounts over /etc/hosts) gives the headless Service's name one address per ready worker and
each worker its pod name, through glibc's getaddrinfo/gethostbyaddr. Editing that file is adding or
removing a ready pod.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_helpers import REPO, manifests, render, renderer, start_cluster_or_skip
from emucluster import EmulatedCluster

pytestmark = pytest.mark.timeout(240)

SERVICE = "job-hora-worker"
NAMESPACE = "team"
FQDN = f"{SERVICE}.{NAMESPACE}.svc.cluster.local"


@pytest.fixture(scope="module")
def cluster():
    emulated = start_cluster_or_skip(3)
    netns_dir = Path("/etc/netns") / emulated.hosts[0].netns
    try:
        emulated.check_ssh()
        netns_dir.mkdir(parents=True, exist_ok=True)
        (netns_dir / "hosts").write_text("127.0.0.1 localhost\n")
        yield emulated
    finally:
        shutil.rmtree(netns_dir, ignore_errors=True)
        emulated.close()


def pod(i: int) -> str:
    return f"{SERVICE}-{i}.{FQDN}"


def serve(cluster: EmulatedCluster, workers: list[int]) -> None:
    """The launcher host's DNS view: the Service resolves to these workers (emulated hosts 2, 3)."""
    lines = ["127.0.0.1 localhost"]
    for i in workers:
        lines.append(f"{cluster.hosts[i + 1].address} {pod(i)} {FQDN}")
    hosts = Path("/etc/netns") / cluster.hosts[0].netns / "hosts"
    with open(hosts, "r+") as handle:  # in place: the bind mount of a running launcher sees it
        handle.truncate(0)
        handle.write("\n".join(lines) + "\n")


def in_launcher_host(cluster, argv, **kwargs):
    return subprocess.run(cluster.hosts[0].exec_argv(argv), capture_output=True, text=True,
                          cwd=str(REPO), **kwargs)


def test_deploy_discover_lists_ready_pods_by_name_and_address(cluster):
    serve(cluster, [0, 1])
    hora = [sys.executable, "-m", "hora", "discover", "kubernetes"]
    result = in_launcher_host(cluster, [*hora, "--service", SERVICE, "--namespace", NAMESPACE, "--slots", "4"],
                              timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{pod(0)}:4", f"{pod(1)}:4"]
    result = in_launcher_host(cluster, [*hora, "--service", FQDN, "--addresses"], timeout=60)
    assert result.stdout.splitlines() == [f"{cluster.hosts[1].address}:1", f"{cluster.hosts[2].address}:1"]


def test_deploy_discover_unresolved_service_is_logged_retried_then_fails(cluster):
    serve(cluster, [])
    started = time.monotonic()
    result = in_launcher_host(cluster, [sys.executable, "-m", "hora", "discover", "kubernetes", "--service",
                                        SERVICE, "--namespace", NAMESPACE, "--wait", "2.5"], timeout=60)
    took = time.monotonic() - started
    assert result.returncode == 1 and result.stdout == ""
    retries = [line for line in result.stderr.splitlines() if "retrying in" in line]
    assert len(retries) >= 2 and f"{FQDN} does not resolve" in retries[0], result.stderr
    assert "gave up after" in result.stderr and took < 30, (took, result.stderr)
    # A name that starts resolving while it retries is answered.
    proc = subprocess.Popen(cluster.hosts[0].exec_argv(
        [sys.executable, "-m", "hora", "discover", "kubernetes", "--service", FQDN, "--wait", "20"]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    first = proc.stderr.readline()  # the first failed attempt, logged
    assert "retrying in" in first and "does not resolve" in first, first
    serve(cluster, [1])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.splitlines() == [f"{pod(1)}:1"], err


JOB = """
import json, os, time
import numpy as np
import hora, hora.elastic

hora.init()
state = hora.elastic.ObjectState(step=0)

@hora.elastic.run
def train(state):
    while not os.path.exists(os.environ["STOP"]):
        total = hora.allreduce(np.ones(2), op=hora.Sum, name="step")
        if hora.rank() == 0:
            print("LOG " + json.dumps({"step": state.step, "size": hora.size(), "sum": float(total[0])}), flush=True)
        state.step += 1
        state.commit()
        time.sleep(0.2)

train(state)
"""


def test_deploy_elastic_job_follows_the_charts_discovery_script(cluster, tmp_path):
    try:
        tool = renderer()
    except RuntimeError as exc:
        pytest.fail(f"cannot render the chart: {exc}")
    rendered = render(tool, {"elastic": {"enabled": True, "minWorkers": 1, "maxWorkers": 2}}, tmp_path,
                      namespace=NAMESPACE)
    assert rendered.returncode == 0, rendered.stderr
    script_text = manifests(rendered.stdout)["ConfigMap/job-hora-discovery"]["data"]["discover_hosts.sh"]
    # The chart's script calls `hora` from PATH, as in the image; here it is this Python's.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "hora").write_text(f"#!/bin/sh\nexec {sys.executable} -m hora \"$@\"\n")
    (bindir / "hora").chmod(0o755)
    script = tmp_path / "discover_hosts.sh"
    script.write_text(script_text)
    script.chmod(0o755)
    stop = tmp_path / "stop"
    serve(cluster, [0])
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", STOP=str(stop),
               PYTHONPATH=str(REPO / "src"))
    argv = [sys.executable, "-m", "hora", "run", "-np", "1", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(script), *cluster.ssh_flags(), "--network-interfaces", "hora0",
            "--elastic-timeout", "60", sys.executable, "-c", JOB]
    proc = subprocess.Popen(cluster.hosts[0].exec_argv(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(REPO), env=env)
    sizes: list[int] = []
    try:
        def wait_for_size(size: int, timeout: float = 60) -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                if "LOG " in line:
                    entry = json.loads(line.split("LOG ", 1)[1])
                    sizes.append(entry["size"])
                    assert entry["sum"] == entry["size"]
                    if entry["size"] == size:
                        return
            raise AssertionError(f"the job never reached size {size}; sizes {sizes[-10:]}")

        wait_for_size(1)
        serve(cluster, [0, 1])  # a second worker pod became ready
        wait_for_size(2)
        serve(cluster, [0])  # ... and went away (scaled down)
        wait_for_size(1)
        stop.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1, sizes
