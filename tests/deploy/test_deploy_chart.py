"""charts/hora renders, validates against the Kubernetes API schemas, and builds the right objects.

Rendered by ``helm template`` where helm exists, else by the real Go template engine with sprig
(tests/deploy/helmrender, built from Debian's packages). Every manifest goes through
``kubernetes-validate`` in strict mode (unknown fields are errors).
"""

from __future__ import annotations

import subprocess

import pytest
from deploy_helpers import manifests, render, renderer

kubernetes_validate = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.timeout(600)

GPU_ELASTIC = {
    "workers": 8, "slotsPerWorker": 4,
    "image": {"repository": "registry.example/hora", "tag": "cuda"},
    "resources": {"gpus": 4, "cpu": "16", "memory": "64Gi"},
    "elastic": {"enabled": True, "minWorkers": 2, "maxWorkers": 12},
    "command": ["python", "/data/train.py", "--epochs", "90"],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "hostNetwork": True,
    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "imagenet"}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
}


@pytest.fixture(scope="module")
def tool():
    try:
        return renderer()
    except RuntimeError as exc:
        pytest.fail(f"cannot render the chart: {exc}")


@pytest.fixture(scope="module")
def rendered(tool, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("values")
    out = {}
    for label, values in (("default", None), ("gpu", GPU_ELASTIC)):
        result = render(tool, values, tmp)
        assert result.returncode == 0, result.stderr
        out[label] = manifests(result.stdout)
    return out


def test_deploy_every_manifest_validates_against_the_kubernetes_schemas(rendered):
    kinds = set()
    for objects in rendered.values():
        for obj in objects.values():
            kubernetes_validate.validate(obj, "1.37.0", strict=True)  # raises ValidationError
            kinds.add(obj["kind"])
    assert kinds == {"StatefulSet", "Job", "Service", "Secret", "ConfigMap"}


def _container(obj):
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_deploy_default_values_make_a_fixed_size_ssh_job(rendered):
    objects = rendered["default"]
    workers = objects["StatefulSet/job-hora-worker"]
    assert workers["spec"]["replicas"] == 2 and workers["spec"]["serviceName"] == "job-hora-worker"
    assert _container(workers)["args"] == ["worker"]
    assert "nvidia.com/gpu" not in _container(workers)["resources"]["limits"]
    service = objects["Service/job-hora-worker"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == workers["spec"]["selector"]["matchLabels"]
    launcher = _container(objects["Job/job-hora-launcher"])
    hosts = ("job-hora-worker-0.job-hora-worker.team.svc.cluster.local:1,"
             "job-hora-worker-1.job-hora-worker.team.svc.cluster.local:1")
    assert launcher["args"] == ["hora", "run", "-np", "2", "-H", hosts,
                                "python", "/opt/hora-examples/pytorch_mnist.py", "--epochs", "2"]
    env = {e["name"]: e.get("value") for e in launcher["env"]}
    assert env["HORA_WAIT_FOR_HOSTS"] == hosts
    secret = objects["Secret/job-hora-ssh"]
    import base64
    key = base64.b64decode(secret["data"]["id_rsa"]).decode()
    assert key.startswith("-----BEGIN RSA PRIVATE KEY-----")
    # The generated key is a real key ssh accepts (the entrypoint derives authorized_keys from it).
    for obj in (workers, objects["Job/job-hora-launcher"]):
        spec = obj["spec"]["template"]["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "ssh-key")
        assert volume["secret"] == {"secretName": "job-hora-ssh", "defaultMode": 0o600}
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "ssh-key")
        assert mount["mountPath"] == "/etc/hora/ssh" and mount["readOnly"] is True
        assert spec["securityContext"]["runAsUser"] == 1000


def test_deploy_generated_key_is_usable_by_openssh(rendered, tmp_path):
    import base64
    key = tmp_path / "id_rsa"
    key.write_bytes(base64.b64decode(rendered["default"]["Secret/job-hora-ssh"]["data"]["id_rsa"]))
    key.chmod(0o600)
    result = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("ssh-rsa "), result.stderr


def test_deploy_gpu_elastic_eight_workers(rendered):
    objects = rendered["gpu"]
    workers = objects["StatefulSet/job-hora-worker"]
    assert workers["spec"]["replicas"] == 8
    container = _container(workers)
    assert container["image"] == "registry.example/hora:cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    spec = workers["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
    launcher = _container(objects["Job/job-hora-launcher"])
    assert launcher["args"][:12] == ["hora", "run", "-np", "32", "--min-np", "8", "--max-np", "48",
                                     "--host-discovery-script", "/etc/hora/discovery/discover_hosts.sh",
                                     "--elastic-timeout", "600"]
    assert launcher["args"][12:] == ["python", "/data/train.py", "--epochs", "90"]
    assert "HORA_WAIT_FOR_HOSTS" not in {e["name"] for e in launcher["env"]}
    script = objects["ConfigMap/job-hora-discovery"]["data"]["discover_hosts.sh"]
    assert ("hora discover kubernetes --service job-hora-worker --namespace team --slots 4"
            in script), script
    launcher_spec = objects["Job/job-hora-launcher"]["spec"]["template"]["spec"]
    discovery = next(v for v in launcher_spec["volumes"] if v["name"] == "discovery")
    assert discovery["configMap"]["name"] == "job-hora-discovery"


@pytest.mark.parametrize("values, message", [
    ({"elastic": {"enabled": True, "minWorkers": 5, "maxWorkers": 3}},
     "elastic.minWorkers (5) is greater than elastic.maxWorkers (3)"),
    ({"command": []}, "command is required"),
    ({"workers": 0}, "workers must be at least 1"),
])
def test_deploy_bad_values_fail_at_render_time(tool, tmp_path, values, message):
    result = render(tool, values, tmp_path)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
