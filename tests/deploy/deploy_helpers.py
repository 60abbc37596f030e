"""Shared by the deployment tests: rendering charts/hora with the Go template engine, and paths."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHART = REPO / "charts" / "hora"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
GOPATH = "/usr/share/gocode"


@functools.cache
def _renderer() -> tuple[str, ...]:
    return tuple(_build_renderer())


def renderer() -> list[str]:
    """The chart renderer's command (built once per test session)."""
    return list(_renderer())


def _build_renderer() -> list[str]:
    """``helm template`` when helm is installed, else tests/deploy/helmrender built with Debian's Go
    and sprig (RuntimeError naming what is missing)."""
    if shutil.which("helm"):
        return ["helm"]
    go = shutil.which("go")
    if go is None or not os.path.isdir(f"{GOPATH}/src/github.com/Masterminds/sprig"):
        raise RuntimeError("neither helm nor Go with sprig is installed "
                           "(apt-get install golang-go golang-github-masterminds-sprig-dev)")
    out = Path(tempfile.mkdtemp(prefix="hora-helmrender-")) / "helmrender"
    env = dict(os.environ, GO111MODULE="off", GOPATH=GOPATH, GOFLAGS="")
    if "HOME" not in env and "GOCACHE" not in env:  # Go's build cache otherwise lives under $HOME
        env["GOCACHE"] = str(out.parent / "cache")
    result = subprocess.run([go, "build", "-o", str(out), "main.go"], cwd=HERE / "helmrender", env=env,
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"building helmrender failed: {result.stderr.strip()}")
    return [str(out)]


def render(tool: list[str], values: dict | None, tmp: Path, release: str = "job",
           namespace: str = "team") -> subprocess.CompletedProcess:
    """Render the chart with ``values`` laid over values.yaml (text output, not checked)."""
    files: list[str] = []
    if values is not None:
        path = tmp / f"values-{len(list(tmp.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(values))
        files.append(str(path))
    if tool == ["helm"]:
        argv = ["helm", "template", release, str(CHART), "--namespace", namespace]
        for path in files:
            argv += ["-f", path]
    else:
        argv = [*tool, str(CHART), release, namespace, *files]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def manifests(text: str) -> dict[str, dict]:
    """``Kind/name`` -> object of a rendered stream."""
    objects = {}
    for doc in yaml.safe_load_all(text):
        if doc:
            objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return objects


def start_cluster_or_skip(hosts: int):
    """An emulated cluster of ``hosts`` started, or the test skipped saying why none can run here."""
    import pytest
    from emucluster import ClusterUnavailable, EmulatedCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no emulated cluster: {reason}")
    try:
        return EmulatedCluster(hosts).start()
    except ClusterUnavailable as exc:
        pytest.skip(f"no emulated cluster: {exc}")
