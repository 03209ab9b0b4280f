"""Every manifest the kind path renders, for every shipped topology, on CPU and GPU clusters:
strict schema validation (unknown fields fail) against the pinned Kubernetes version, and the
properties the lab relies on (secure defaults, labels that selectors and discovery match, RBAC
limited to reading pods/EndpointSlices, no secret values)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from conftest import IN_CI
from kvlab.stack.kind import versions
from kvlab.stack.kind.manifests import render, to_yaml
from kvlab.stack.kind.objects import NODE_PORTS, REPLICA_SELECTOR, Cluster
from kvlab.stack.kind.observability import prometheus_config
from kvlab.topology import ObservabilitySettings, Pool, Topology, load_topology

if not IN_CI:  # in CI a missing validator fails at import instead of skipping
    pytest.importorskip("kubernetes_validate")
import kubernetes_validate

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = sorted((ROOT / "labs" / "topologies").glob("*.yaml"))


def _all(topology: Topology, gpu: bool, **kw) -> list[dict]:
    return [x for ms in render(topology, Cluster(gpu=gpu, **kw)).values() for x in ms]


def _pod_specs(manifests: list[dict]) -> list[tuple[dict, dict]]:
    return [(x, x["spec"]["template"]["spec"]) for x in manifests if x["kind"] in ("Deployment", "DaemonSet")]


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, bool], list[dict]]:
    assert TOPOLOGIES, "no shipped topologies found"
    return {(p.stem, gpu): _all(load_topology(p), gpu) for p in TOPOLOGIES for gpu in (False, True)}


def test_every_manifest_validates_strictly(rendered):
    checked = 0
    for (name, gpu), manifests in rendered.items():
        for x in manifests:
            try:
                kubernetes_validate.validate(x, versions.KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name} gpu={gpu} {x['kind']}/{x['metadata']['name']}: "
                            f"{'.'.join(map(str, exc.path))}: {exc.message}")
            checked += 1
    assert checked >= 2 * len(TOPOLOGIES) * 15


def test_validation_is_strict():
    """A typo'd field fails, so the test above could fail."""
    deployment = next(x for x in _all(Topology(), False) if x["kind"] == "Deployment")
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, versions.KUBERNETES_VERSION, strict=True)


def test_yaml_round_trip_has_no_aliases():
    manifests = _all(Topology(), True)
    text = to_yaml(manifests)
    assert "&id" not in text and "*id" not in text
    assert list(yaml.safe_load_all(text)) == manifests


@pytest.mark.parametrize("gpu", [False, True])
def test_secure_defaults(rendered, gpu):
    for (name, g), manifests in rendered.items():
        if g != gpu:
            continue
        for x, spec in _pod_specs(manifests):
            if x["metadata"]["name"] == "nvidia-device-plugin":
                continue  # needs the kubelet's socket directory; checked in test_gpu_plumbing
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            for c in spec["containers"] + spec.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
                assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
                assert sc["capabilities"] == {"drop": ["ALL"]}
                assert set(c["resources"]["requests"]) >= {"cpu", "memory"}
                assert set(c["resources"]["limits"]) >= {"cpu", "memory"}
            for v in spec.get("volumes", []):
                assert "hostPath" not in v, (name, v)
            if spec.get("serviceAccountName") is None:
                assert spec["automountServiceAccountToken"] is False
        namespace = next(x for x in manifests if x["kind"] == "Namespace" and x["metadata"]["name"] == "kvlab")
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_no_secret_values(rendered):
    for (name, _gpu), manifests in rendered.items():
        assert not [x for x in manifests if x["kind"] == "Secret"]
        text = json.dumps(manifests)
        assert "hf_" not in text.lower().replace("hf_token", "").replace("hf_home", "")
        for _, spec in _pod_specs(manifests):
            for c in spec["containers"] + spec.get("initContainers", []):
                for env in c.get("env", []):
                    if "TOKEN" in env["name"] or "PASSWORD" in env["name"]:
                        assert "value" not in env, (name, env)
                        assert env["valueFrom"]["secretKeyRef"]["optional"] is True


def test_replicas_services_and_discovery_agree():
    topo = Topology(pools=[Pool(name="prefill", role="prefill", replicas=2), Pool(name="decode", role="decode", replicas=3)])
    for gpu in (False, True):
        manifests = _all(topo, gpu)
        deployments = {x["metadata"]["name"]: x for x in manifests if x["kind"] == "Deployment"}
        assert deployments["kvlab-prefill"]["spec"]["replicas"] == 2
        assert deployments["kvlab-decode"]["spec"]["replicas"] == 3
        selector = dict(kv.split("=") for kv in REPLICA_SELECTOR.split(","))
        for pool in ("prefill", "decode"):
            d = deployments[f"kvlab-{pool}"]
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert labels.items() >= selector.items()
            assert labels["kvlab.io/role"] == pool
            assert labels.items() >= d["spec"]["selector"]["matchLabels"].items()
            ports = {p["name"]: p["containerPort"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]}
            assert ports == {"http": 8000, "kv-events": 5557, **({"nixl": 5600} if gpu else {})}   # P/D: test_manifests_pd
        baseline = next(x for x in manifests if x["kind"] == "Service" and x["metadata"]["name"] == "kvlab-baseline")
        assert baseline["spec"]["selector"].items() <= selector.items()
        assert baseline["spec"]["ports"][0]["nodePort"] == NODE_PORTS["baseline"]
        gw = deployments["kvlab-gateway"]["spec"]["template"]["spec"]
        args = gw["containers"][0]["args"]
        assert args[args.index("--discovery") + 1] == "kubernetes"
        assert args[args.index("--selector") + 1] == REPLICA_SELECTOR
        assert args[args.index("--replica-port") + 1] == "8000"
        assert args[args.index("--replica-kv-events-port") + 1] == "5557"
        assert gw["serviceAccountName"] == "kvlab-gateway"


def test_gateway_rbac_reads_pods_and_endpointslices_only():
    manifests = _all(Topology(), False)
    role = next(x for x in manifests if x["kind"] == "Role" and x["metadata"]["name"] == "kvlab-gateway")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {(g, r, v) for g, r in [("", "pods"), ("discovery.k8s.io", "endpointslices")]
                       for v in ("get", "list", "watch")}
    assert not [x for x in manifests if x["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def _deployment(manifests: list[dict], name: str) -> dict:
    return next(x for x in manifests if x["kind"] == "Deployment" and x["metadata"]["name"] == name)


def test_sim_on_cpu_vllm_on_gpu():
    topo = Topology(model="kvlab-tiny")
    cpu = _deployment(_all(topo, False), "kvlab-replicas")["spec"]["template"]["spec"]
    c = cpu["containers"][0]
    assert c["image"] == "kvlab:0.1.0" and c["command"] == ["kvlab"] and c["args"][:2] == ["engine", "sim"]
    assert "runtimeClassName" not in cpu and "nvidia.com/gpu" not in c["resources"]["limits"]
    gpu = _deployment(_all(topo, True), "kvlab-replicas")["spec"]["template"]["spec"]
    v = gpu["containers"][0]
    assert v["image"] == versions.VLLM_IMAGE and ":" in v["image"] and not v["image"].endswith(":latest")
    assert gpu["runtimeClassName"] == "nvidia"
    assert v["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = v["args"]
    assert args[0] == versions.VLLM_MODEL
    assert args[args.index("--served-model-name") + 1] == "kvlab-tiny"
    assert "--enable-prefix-caching" in args
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:5557" and events["publisher"] == "zmq" and events["enable_kv_cache_events"]
    assert args[args.index("--otlp-traces-endpoint") + 1] == "http://kvlab-jaeger.kvlab.svc:4318/v1/traces"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}}} in v["env"]
    # the gateway hashes the real model's token ids: its tokenizer is fetched before it starts
    gw = _deployment(_all(topo, True), "kvlab-gateway")["spec"]["template"]["spec"]
    assert gw["initContainers"][0]["command"][-2:] == [versions.VLLM_MODEL, "/tokenizer"]
    assert "--tokenizer" in gw["containers"][0]["args"]


def test_observability_follows_the_topology():
    kinds = lambda t: {x["metadata"]["name"] for x in render(t, Cluster())["observability"]}  # noqa: E731
    full = kinds(Topology())
    assert {"kvlab-jaeger", "kvlab-prometheus", "kvlab-grafana"} <= full
    off = Topology(observability=ObservabilitySettings(traces="off", prometheus="off"))
    assert kinds(off) == {"kvlab"}
    sim = next(x for x in render(off, Cluster())["baseline"] if x["kind"] == "Deployment")
    env = sim["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "OTEL_TRACES_EXPORTER", "value": "none"} in env


def test_prometheus_scrapes_replicas_and_gateway_by_pod_discovery():
    config = prometheus_config(Cluster(namespace="lab"))
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"replicas", "gateway"}
    for job, component in (("replicas", "replica"), ("gateway", "gateway")):
        sd = jobs[job]["kubernetes_sd_configs"][0]
        assert sd["namespaces"]["names"] == ["lab"]
        assert sd["selectors"][0]["label"] == f"app.kubernetes.io/component={component}"
    # every scraped pod template carries the annotations the relabelling keeps
    for x in _all(Topology(), False):
        if x["kind"] == "Deployment" and x["metadata"]["labels"]["app.kubernetes.io/component"] in ("replica", "gateway"):
            assert x["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_grafana_is_provisioned_from_dashboards_dir(tmp_path):
    (tmp_path / "provisioning" / "datasources").mkdir(parents=True)
    (tmp_path / "provisioning" / "datasources" / "ds.yaml").write_text(yaml.safe_dump({"apiVersion": 1, "datasources": [
        {"name": "Prom", "type": "prometheus", "uid": "kvlab-prom", "url": "http://127.0.0.1:9090"}]}))
    (tmp_path / "before-after.json").write_text(json.dumps({"title": "Before / after", "panels": []}))
    obs = render(Topology(), Cluster(dashboards_dir=tmp_path))["observability"]
    maps = {x["metadata"]["name"]: x["data"] for x in obs if x["kind"] == "ConfigMap"}
    assert json.loads(maps["kvlab-grafana-dashboards"]["before-after.json"])["title"] == "Before / after"
    ds = yaml.safe_load(maps["kvlab-grafana-datasources"]["datasources.yaml"])["datasources"]
    assert ds == [{"name": "Prom", "type": "prometheus", "uid": "kvlab-prom", "url": "http://kvlab-prometheus.kvlab.svc:9090",
                   "access": "proxy", "editable": False}]
    # an empty dashboards dir still renders (the default datasources)
    empty = render(Topology(), Cluster(dashboards_dir=tmp_path / "none"))["observability"]
    ds = yaml.safe_load(next(x for x in empty if x["metadata"]["name"] == "kvlab-grafana-datasources")["data"]["datasources.yaml"])
    assert {d["type"] for d in ds["datasources"]} == {"prometheus", "jaeger"}


def test_gpu_plumbing():
    phases = render(Topology(), Cluster(gpu=True))
    assert list(phases) == ["gpu", "baseline", "gateway", "observability"]
    kinds = {x["kind"]: x for x in phases["gpu"]}
    assert kinds["RuntimeClass"]["handler"] == "nvidia"
    ds = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert ds["runtimeClassName"] == "nvidia" and ds["containers"][0]["image"] == versions.NVIDIA_DEVICE_PLUGIN_IMAGE
    assert ds["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "gpu" not in render(Topology(), Cluster(gpu=False))


def test_bad_pool_name_is_a_config_error():
    from kvlab.errors import ConfigError

    with pytest.raises(ConfigError, match="DNS label"):
        render(Topology(pools=[Pool(name="Big_Pool")]), Cluster())
