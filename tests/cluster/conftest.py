"""Fixtures for the emulated-cluster tests: the cluster itself and a launcher starter.

The cluster (4 namespace hosts, links shaped to 1 Gbit/s, an sshd on each) is built once per test
session and torn down at its end, also when tests fail. Where this machine cannot build it (not
root, no ``ip netns``, no sshd), every test here is skipped with the reason.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator

import pytest
from cluster_helpers import REPO, clean_env
from emucluster import ClusterUnavailable, EmulatedCluster, unavailable_reason


@pytest.fixture(scope="session")
def cluster() -> Iterator[EmulatedCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no emulated cluster: {reason}")
    try:
        emulated = EmulatedCluster(4, rate="1gbit").start()
    except ClusterUnavailable as exc:
        pytest.skip(f"no emulated cluster: {exc}")
    try:
        try:
            emulated.check_links()
        except ClusterUnavailable as exc:
            pytest.skip(f"no emulated cluster: {exc}")
        emulated.check_ssh()
        yield emulated
    finally:
        emulated.close()


@pytest.fixture
def launcher() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start a launcher command line (text pipes); killed at teardown if still running."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=clean_env(env), cwd=str(REPO))
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
