"""The kind path without a cluster: kind configs against kind's config schema, the image
Dockerfile, and the full dry-run plans of `kvlab cluster` on CPU and GPU hosts."""

from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvlab.stack.kind import cli, plan, versions
from kvlab.stack.kind.objects import KVLAB_UID, NODE_PORTS, Cluster
from kvlab.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "kind" / "schema" / "cluster-v1alpha4.json").read_text())
CONFIGS = ["cpu.yaml", "gpu.yaml"]


def _config(name: str) -> dict:
    return yaml.safe_load((ROOT / "kind" / name).read_text())


@pytest.mark.parametrize("name", CONFIGS)
def test_kind_config_matches_schema_and_pins(name):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    config = _config(name)
    jsonschema.Draft202012Validator(SCHEMA).validate(config)
    assert {n["image"] for n in config["nodes"]} == {versions.KIND_NODE_IMAGE}
    assert "@sha256:" in versions.KIND_NODE_IMAGE
    assert versions.KIND_NODE_IMAGE.split(":")[1].split("@")[0] == "v" + versions.KUBERNETES_VERSION
    control = [n for n in config["nodes"] if n["role"] == "control-plane"]
    assert len(control) == 1
    published = {(p["containerPort"], p["hostPort"], p["listenAddress"]) for p in control[0]["extraPortMappings"]}
    assert published == {(port, port, "127.0.0.1") for port in NODE_PORTS.values()}
    assert sum(n["role"] == "worker" for n in config["nodes"]) >= 2


@pytest.mark.parametrize("bad", [
    {"nodes": [{"role": "worker", "extraMount": []}]},                       # typo'd field
    {"nodes": [{"role": "master"}]},                                           # unknown role
    {"networking": {"kubeProxyMode": "userspace"}},                            # removed mode
    {"nodes": [{"role": "worker", "extraMounts": [{"hostPath": "/dev/null"}]}]},  # containerPath missing
    {"unknownTopLevel": True},
])
def test_kind_schema_is_strict(bad):
    config = {"kind": "Cluster", "apiVersion": "kind.x-k8s.io/v1alpha4", **bad}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(config)


@pytest.mark.processes
def test_gpu_config_exposes_gpus_the_nvkind_way():
    gpu_workers = [n for n in _config("gpu.yaml")["nodes"] if (n.get("labels") or {}).get("kvlab.io/gpu") == "true"]
    assert len(gpu_workers) == 1
    assert {"hostPath": "/dev/null", "containerPath": "/var/run/nvidia-container-devices/all"} in gpu_workers[0]["extraMounts"]
    assert not any("extraMounts" in n for n in _config("cpu.yaml")["nodes"])
    assert plan.gpu_nodes(ROOT / "kind" / "gpu.yaml", "kvlab") == ["kvlab-worker"]
    script = (ROOT / "kind" / "gpu-node.sh").read_text()
    assert "nvidia-ctk runtime configure --runtime=containerd" in script
    assert subprocess.run(["bash", "-n", str(ROOT / "kind" / "gpu-node.sh")]).returncode == 0


def test_dockerfile_non_root_entrypoint_and_context():
    text = (ROOT / "kind" / "images" / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}$", text, re.M) and "python:3.12-slim" in text
    assert re.search(rf"^USER {KVLAB_UID}:{KVLAB_UID}$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["kvlab"\]$', text, re.M)
    assert 'pip install ".[cluster]"' in text
    ignore = (ROOT / "kind" / "images" / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1:][:3] == ["!pyproject.toml", "!README.md", "!instrumentation/"]
    for copied in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for src in copied.split():
            assert (ROOT / src).exists(), src


def _steps(argv: list[str]) -> list[plan.Step]:
    return cli.build_plan(cli._parser().parse_args(argv))


def test_cpu_plan_in_order():
    create = _steps(["create"])
    assert [s.argv[:3] for s in create] == [["kind", "version"], ["kind", "create", "cluster"]]
    assert create[1].argv[create[1].argv.index("--config") + 1].endswith("kind/cpu.yaml")

    deploy = _steps(["deploy", "--topology", "quickstart"])
    described = [s.describe() for s in deploy]
    order = [s.action + ":" + (s.what if s.action != "rollout" else s.name or "") for s in deploy]
    assert order == [
        "apply:observability", "rollout:kvlab-jaeger", "rollout:kvlab-prometheus", "rollout:kvlab-grafana",
        "run:build the kvlab image", "run:load the image into the kind nodes",
        "apply:baseline", "rollout:kvlab-replicas",
        "apply:gateway", "rollout:kvlab-gateway",
    ], described
    build, load = deploy[4].argv, deploy[5].argv
    assert build[:2] == ["docker", "build"] and build[build.index("-t") + 1] == "kvlab:0.1.0"
    assert load == ["kind", "load", "docker-image", "kvlab:0.1.0", "--name", "kvlab"]
    images = {c["image"] for s in deploy if s.action == "apply" for x in s.manifests
              if x["kind"] == "Deployment" for c in x["spec"]["template"]["spec"]["containers"]}
    assert images == {"kvlab:0.1.0", versions.JAEGER_IMAGE, versions.PROMETHEUS_IMAGE, versions.GRAFANA_IMAGE}
    assert all(s.context == "kind-kvlab" for s in deploy if s.action in ("apply", "rollout"))

    only_gateway = _steps(["deploy", "gateway", "--no-build"])
    assert [s.action for s in only_gateway] == ["apply", "rollout"]
    assert _steps(["delete", "--name", "lab2"])[0].argv == ["kind", "delete", "cluster", "--name", "lab2"]


def test_gpu_plan_in_order_without_secret_values():
    create = _steps(["create", "--gpu", "--topology", "gpu-4"])
    assert [s.action for s in create] == ["run", "run", "run", "run", "apply", "rollout", "gpus"]
    assert create[1].argv[create[1].argv.index("--config") + 1].endswith("kind/gpu.yaml")
    assert create[2].argv[:2] == ["docker", "cp"] and create[2].argv[-1] == "kvlab-worker:/kvlab-gpu-node.sh"
    assert create[3].argv == ["docker", "exec", "kvlab-worker", "bash", "/kvlab-gpu-node.sh"]
    assert {x["kind"] for x in create[4].manifests} == {"RuntimeClass", "Namespace", "DaemonSet"}

    deploy = _steps(["deploy", "baseline", "gateway", "--gpu", "--topology", "gpu-1", "--hf-model", "Qwen/Qwen3-0.6B"])
    # preflight before anything of the GPU phase is applied, so no rollout wait hides a missing GPU
    assert [s.action for s in deploy] == ["run", "run", "note", "preflight", "apply", "rollout", "apply", "rollout"]
    replicas = next(x for x in deploy[4].manifests if x["kind"] == "Deployment")
    assert replicas["spec"]["template"]["spec"]["containers"][0]["image"] == versions.VLLM_IMAGE
    assert deploy[5].timeout_s >= 1200  # the model download
    out = io.StringIO()
    plan.print_plan(create + deploy, out)
    text = out.getvalue()
    assert "kind: Secret" not in text and "--from-file=token=" in text and "--from-literal" not in text
    assert not re.search(r"hf_[A-Za-z0-9]{20,}", text)


def test_dry_run_touches_nothing(monkeypatch, capsys):
    def forbidden(*a, **k):
        raise AssertionError("dry-run must not run commands or reach a cluster")

    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    import kvlab.stack.kind.runner as runner

    monkeypatch.setattr(runner, "api_client", forbidden)
    for argv in (["create", "--gpu", "--topology", "gpu-1"], ["deploy", "--gpu", "--topology", "gpu-2"], ["deploy"], ["delete"]):
        assert cli.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[1/" in out and "kind: Deployment" in out and "vllm/vllm-openai" in out
    manifest = "\n".join(line for line in out.splitlines() if not line.startswith("["))
    docs = [d for d in yaml.safe_load_all(manifest.replace("\n...\n", "\n---\n")) if d]
    assert any(d.get("kind") == "Service" and d["metadata"]["name"] == "kvlab-baseline" for d in docs)


def test_bad_phase_and_topology_are_reported(capsys):
    assert cli.main(["deploy", "canary", "--dry-run"]) == 1
    assert "unknown phase" in capsys.readouterr().err
    assert cli.main(["deploy", "--topology", "nope", "--dry-run"]) == 1
    assert "no topology named" in capsys.readouterr().err


def test_cluster_target_uses_published_node_ports():
    from kvlab.stack.kind import cluster_target

    assert cluster_target("gateway", via="nodeport") == f"http://127.0.0.1:{NODE_PORTS['gateway']}"
    assert cluster_target("baseline", via="nodeport") == f"http://127.0.0.1:{NODE_PORTS['baseline']}"
    from kvlab.errors import StackError

    with pytest.raises(StackError):
        cluster_target("grafana")


def test_rollout_state_reads_real_status_objects():
    from kubernetes.client import V1Deployment, V1DeploymentSpec, V1DeploymentStatus, V1ObjectMeta

    from kvlab.stack.kind.runner import rollout_state

    def dep(gen: int, observed: int, updated: int, available: int, total: int) -> V1Deployment:
        return V1Deployment(metadata=V1ObjectMeta(generation=gen),
                            spec=V1DeploymentSpec(replicas=4, selector={}, template={}),
                            status=V1DeploymentStatus(observed_generation=observed, updated_replicas=updated,
                                                      available_replicas=available, replicas=total))

    assert rollout_state("Deployment", dep(2, 2, 4, 4, 4)) == (True, "4/4 available, 4 updated")
    assert not rollout_state("Deployment", dep(3, 2, 4, 4, 4))[0]   # new spec not seen yet
    assert not rollout_state("Deployment", dep(2, 2, 4, 4, 5))[0]   # an old pod still terminating
    assert not rollout_state("Deployment", dep(2, 2, 2, 4, 4))[0]


def test_cluster_defaults_are_the_pinned_ones():
    c = Cluster()
    assert (c.context, c.namespace, c.vllm_image, c.hf_model) == ("kind-kvlab", "kvlab", versions.VLLM_IMAGE, versions.VLLM_MODEL)
    assert Topology().total_replicas == 4


def test_status_prints_real_objects_even_half_filled(monkeypatch, capsys):
    """`kvlab cluster status` reads the client's objects, whose fields are all optional: a pod not
    yet scheduled has no IP or node, a deployment just created no status."""
    from kubernetes import client
    from kubernetes.client import (
        V1Container,
        V1Deployment,
        V1DeploymentSpec,
        V1DeploymentStatus,
        V1ObjectMeta,
        V1Pod,
        V1PodSpec,
        V1PodStatus,
        V1PodTemplateSpec,
        V1Service,
    )

    def items(*objs):
        return type("List", (), {"items": list(objs)})()

    spec = V1DeploymentSpec(replicas=2, selector={}, template=V1PodTemplateSpec(
        spec=V1PodSpec(containers=[V1Container(name="gw", image="kvlab:1")])))
    deployments = items(V1Deployment(metadata=V1ObjectMeta(name="sim"), spec=spec),
                        V1Deployment(metadata=V1ObjectMeta(name="gateway"), spec=spec,
                                     status=V1DeploymentStatus(ready_replicas=2)))
    pods = items(V1Pod(metadata=V1ObjectMeta(name="sim-0"), spec=V1PodSpec(containers=[]), status=V1PodStatus(phase="Pending")),
                 V1Pod(metadata=V1ObjectMeta(name="gateway-0"), spec=V1PodSpec(containers=[], node_name="n1"),
                       status=V1PodStatus(phase="Running", pod_ip="10.0.0.5")))
    services = items(V1Service(metadata=V1ObjectMeta(name="kvlab-gateway")))
    monkeypatch.setattr(cli, "api_client", lambda context: None)
    monkeypatch.setattr(client, "AppsV1Api", lambda api: type("Apps", (), {
        "list_namespaced_deployment": lambda self, ns, label_selector: deployments})())
    monkeypatch.setattr(client, "CoreV1Api", lambda api: type("Core", (), {
        "list_namespaced_pod": lambda self, ns, label_selector: pods,
        "list_namespaced_service": lambda self, ns: services})())
    assert cli.status(cli._parser().parse_args(["status"])) == 0
    out = capsys.readouterr().out
    assert re.search(r"gateway\s+2/2\s+kvlab:1", out) and re.search(r"sim\s+0/2\s+kvlab:1", out)
    assert re.search(r"sim-0\s+Pending\s+-\s+-", out) and re.search(r"gateway-0\s+Running\s+10\.0\.0\.5\s+n1", out)
