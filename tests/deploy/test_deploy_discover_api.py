"""``hora discover kubernetes --source api``: reading a Service's Endpoints from an API server.

No Kubernetes API server runs here, so a local HTTP server answers the one request the command
makes, with an Endpoints object that kubernetes-validate accepts as a v1 Endpoints; the test checks
the request (path, bearer token) and that only ready addresses are listed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from deploy_helpers import REPO

pytestmark = pytest.mark.timeout(120)

ENDPOINTS = {
    "apiVersion": "v1", "kind": "Endpoints",
    "metadata": {"name": "job-hora-worker", "namespace": "team"},
    "subsets": [{
        "addresses": [{"ip": "10.1.0.7", "hostname": "job-hora-worker-1"},
                      {"ip": "10.1.0.5", "hostname": "job-hora-worker-0"}],
        "notReadyAddresses": [{"ip": "10.1.0.9", "hostname": "job-hora-worker-2"}],
        "ports": [{"name": "ssh", "port": 2222, "protocol": "TCP"}],
    }],
}


@pytest.fixture
def api(tmp_path):
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's naming
            seen.append((self.path, self.headers.get("Authorization")))
            if self.path == "/api/v1/namespaces/team/endpoints/job-hora-worker":
                body, code = json.dumps(ENDPOINTS).encode(), 200
            else:
                body, code = b'{"kind":"Status","code":404}', 404
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    tokens = tmp_path / "sa"
    tokens.mkdir()
    (tokens / "token").write_text("secret-token\n")
    yield f"http://127.0.0.1:{server.server_port}", tokens, seen
    server.shutdown()


def discover(url, *args):
    return subprocess.run([sys.executable, "-m", "hora", "discover", "kubernetes", "--source", "api",
                           "--api-url", url, *args], capture_output=True, text=True, timeout=60, cwd=str(REPO))


def test_deploy_discover_api_lists_ready_endpoints(api, monkeypatch):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(ENDPOINTS, "1.37.0", strict=True)
    url, tokens, seen = api
    monkeypatch.setattr("hora.runner.commands.discover.SERVICE_ACCOUNT_DIR", str(tokens))
    from hora.runner.commands.discover import ServiceQuery, api_hosts
    query = ServiceQuery("job-hora-worker", "team")
    assert api_hosts(query, api_url=url, token_dir=str(tokens)) == [
        "job-hora-worker-0.job-hora-worker.team.svc.cluster.local",
        "job-hora-worker-1.job-hora-worker.team.svc.cluster.local"]
    assert api_hosts(query, addresses=True, api_url=url, token_dir=str(tokens)) == ["10.1.0.5", "10.1.0.7"]
    assert seen[0] == ("/api/v1/namespaces/team/endpoints/job-hora-worker", "Bearer secret-token")
    result = discover(url, "--service", "job-hora-worker", "--namespace", "team", "--slots", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["job-hora-worker-0.job-hora-worker.team.svc.cluster.local:2",
                                          "job-hora-worker-1.job-hora-worker.team.svc.cluster.local:2"]


def test_deploy_discover_api_missing_service_is_retried_then_named(api):
    url, _, seen = api
    result = discover(url, "--service", "nope", "--namespace", "team", "--wait", "1.5")
    assert result.returncode == 1
    assert "answered 404" in result.stderr and "retrying in" in result.stderr, result.stderr
    assert "gave up after" in result.stderr and len(seen) >= 2
