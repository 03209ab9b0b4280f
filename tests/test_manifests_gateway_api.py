"""The Gateway API phases of the kind path: Envoy + `kvlab epp`, Envoy + llm-d's scheduler, and the
InferencePool/Gateway/HTTPRoute objects for a conformant gateway; `kvlab lab --cluster` phase plan.

Core objects are validated strictly by kubernetes-validate; the Envoy bootstrap by Envoy's own
protobuf schema (xds-protos: unknown fields and unknown typed_config types fail) plus the wiring
the data plane depends on; the CRD objects by our own checks of the fields the Inference
Extension's v1 API (and Gateway API v1) define.
"""

from __future__ import annotations

import copy
import importlib
import io
import subprocess

import pytest
import yaml

from kvlab import lab
from kvlab.epp import DESTINATION_HEADER, SERVICE_NAME
from kvlab.stack.kind import envoy, forward, llmd, plan, versions
from kvlab.stack.kind import objects as o
from kvlab.stack.kind.objects import NODE_PORTS, Cluster
from kvlab.topology import Topology

kubernetes_validate = pytest.importorskip("kubernetes_validate")
json_format = pytest.importorskip("google.protobuf.json_format")
bootstrap_pb2 = pytest.importorskip("envoy.config.bootstrap.v3.bootstrap_pb2")

CRD_KINDS = {"InferencePool", "Gateway", "HTTPRoute"}
# the typed_config types our bootstrap names; importing registers them for Any resolution
for module in ("envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2",
               "envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2",
               "envoy.extensions.filters.http.router.v3.router_pb2",
               "envoy.extensions.filters.http.health_check.v3.health_check_pb2",
               "envoy.extensions.upstreams.http.v3.http_protocol_options_pb2"):
    importlib.import_module(module)


@pytest.fixture(scope="module", params=[False, True], ids=["cpu", "gpu"])
def rendered(request) -> dict[str, list[dict]]:
    return plan.gateway_api_phases(Topology(), Cluster(gpu=request.param))


def _by(manifests: list[dict], kind: str, name: str | None = None) -> dict:
    return next(x for x in manifests if x["kind"] == kind and (name is None or x["metadata"]["name"] == name))


def test_core_objects_validate_strictly(rendered):
    checked = 0
    for phase, manifests in rendered.items():
        for x in manifests:
            if x["kind"] in CRD_KINDS:
                continue
            try:
                kubernetes_validate.validate(x, versions.KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{phase} {x['kind']}/{x['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
            checked += 1
    assert checked >= 15


# ----------------------------------------------------------------------------- Envoy

def _parse_envoy(config: dict):
    return json_format.ParseDict(config, bootstrap_pb2.Bootstrap())


def _envoy_of(manifests: list[dict]) -> tuple[dict, dict]:
    cm = next(x for x in manifests if x["kind"] == "ConfigMap" and x["metadata"]["name"].endswith("-envoy"))
    return yaml.safe_load(cm["data"]["envoy.yaml"]), cm


@pytest.mark.parametrize("phase", ["gateway-api", "llm-d"])
def test_envoy_config_is_valid_and_routes_by_the_picked_endpoint(rendered, phase):
    manifests = rendered[phase]
    config, cm = _envoy_of(manifests)
    boot = _parse_envoy(config)                     # Envoy's own schema
    clusters = {c.name: c for c in boot.static_resources.clusters}
    dst = clusters["original_destination_cluster"]
    assert dst.type == dst.ORIGINAL_DST and dst.lb_policy == dst.CLUSTER_PROVIDED
    assert dst.original_dst_lb_config.use_http_header
    assert dst.original_dst_lb_config.http_header_name == DESTINATION_HEADER
    # the ext_proc filter runs before the router, full-duplex both ways, against the picker's port
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    mode = hcm["http_filters"][0]["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert hcm["http_filters"][0]["typed_config"]["failure_mode_allow"] is False
    ext = clusters["ext_proc"]
    assert ext.health_checks[0].grpc_health_check.service_name == SERVICE_NAME
    assert ext.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    ep = ext.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    pod = _by(manifests, "Deployment")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    picker_ports = {p["name"]: p["containerPort"] for p in containers["epp"]["ports"]}
    assert (ep.address, ep.port_value) == ("127.0.0.1", picker_ports["grpc"])
    # the Service reaches Envoy's listener; Envoy reads the config map mounted from this phase
    listener = boot.static_resources.listeners[0].address.socket_address.port_value
    envoy_ports = {p["name"]: p["containerPort"] for p in containers["envoy"]["ports"]}
    assert envoy_ports["http"] == listener == envoy.LISTEN_PORT
    svc = _by(manifests, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "http" and svc["spec"]["ports"][0]["nodePort"] == NODE_PORTS[phase]
    assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} >= {cm["metadata"]["name"]}


def test_envoy_schema_check_catches_a_typo():
    bad = copy.deepcopy(envoy.bootstrap())
    bad["static_resources"]["clusters"][0]["original_dst_lb_config"]["use_http_headers"] = True
    with pytest.raises(json_format.ParseError):
        _parse_envoy(bad)
    wrong_type = copy.deepcopy(envoy.bootstrap())
    hcm = wrong_type["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][0]["typed_config"]["processing_mode"]["request_body_mode"] = "FULL_DUPLEX"
    with pytest.raises(json_format.ParseError):
        _parse_envoy(wrong_type)


def test_kvlab_epp_container_uses_the_gateways_discovery(rendered):
    pod = _by(rendered["gateway-api"], "Deployment")["spec"]["template"]["spec"]
    epp = next(c for c in pod["containers"] if c["name"] == "epp")
    args = epp["args"]
    assert args[0] == "epp" and args[args.index("--discovery") + 1] == "kubernetes"
    assert args[args.index("--port") + 1] == str(envoy.EPP_PORT)
    assert epp["readinessProbe"]["grpc"] == {"port": envoy.EPP_PORT, "service": "readiness"}
    from kvlab.epp.cli import parser

    parser().parse_args([a.replace("$(POD_NAMESPACE)", "kvlab") for a in args[1:]])   # flags kvlab epp has


# ----------------------------------------------------------------------------- CRD objects (our own checks)

def check_inference_pool(x: dict, services: dict[str, dict]) -> list[str]:
    """The fields of InferencePool inference.networking.k8s.io/v1 (Inference Extension v1.0)."""
    errs = []
    if x.get("apiVersion") != "inference.networking.k8s.io/v1":
        errs.append(f"apiVersion {x.get('apiVersion')}")
    spec = x.get("spec", {})
    if set(spec) != {"selector", "targetPorts", "endpointPickerRef"}:
        errs.append(f"spec fields {sorted(spec)}")
    sel = spec.get("selector", {})
    if set(sel) != {"matchLabels"} or not sel["matchLabels"] or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in sel["matchLabels"].items()):
        errs.append("selector must be matchLabels of strings only")
    ports = spec.get("targetPorts", [])
    if len(ports) != 1 or set(ports[0]) != {"number"} or not 1 <= ports[0]["number"] <= 65535:
        errs.append(f"targetPorts {ports}")
    ref = spec.get("endpointPickerRef", {})
    if not set(ref) <= {"group", "kind", "name", "port", "failureMode"} or not ref.get("name"):
        errs.append(f"endpointPickerRef fields {sorted(ref)}")
    if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
        errs.append(f"failureMode {ref.get('failureMode')}")
    if ref.get("kind", "Service") == "Service":
        port = ref.get("port", {}).get("number")
        svc = services.get(ref.get("name", ""))
        if svc is None or port not in [p["port"] for p in svc["spec"]["ports"]]:
            errs.append(f"endpointPickerRef names no rendered Service port {ref.get('name')}:{port}")
    return errs


def check_routes(gateway: dict, route: dict, pools: set[str]) -> list[str]:
    """Gateway and HTTPRoute (gateway.networking.k8s.io/v1) sending to an InferencePool."""
    errs = []
    if not gateway["spec"].get("gatewayClassName") or not gateway["spec"].get("listeners"):
        errs.append("gateway needs gatewayClassName and listeners")
    for listener in gateway["spec"]["listeners"]:
        if set(listener) - {"name", "hostname", "port", "protocol", "tls", "allowedRoutes"} or \
                listener.get("protocol") not in ("HTTP", "HTTPS"):
            errs.append(f"listener {listener}")
    parents = {p["name"] for p in route["spec"]["parentRefs"] if p.get("kind", "Gateway") == "Gateway"}
    if gateway["metadata"]["name"] not in parents:
        errs.append("route is not attached to the gateway")
    for rule in route["spec"]["rules"]:
        if set(rule) - {"name", "matches", "filters", "backendRefs", "timeouts", "retry", "sessionPersistence"}:
            errs.append(f"rule fields {sorted(rule)}")
        for b in rule["backendRefs"]:
            if (b.get("group"), b.get("kind")) != ("inference.networking.k8s.io", "InferencePool") or b["name"] not in pools:
                errs.append(f"backendRef {b}")
    return errs


def test_crd_objects_have_the_v1_fields(rendered):
    for phase in ("inference-pool", "llm-d"):
        manifests = rendered[phase]
        services = {x["metadata"]["name"]: x for x in manifests if x["kind"] == "Service"}
        pool = _by(manifests, "InferencePool")
        assert check_inference_pool(pool, services) == [], phase
    conformant = rendered["inference-pool"]
    pools = {x["metadata"]["name"] for x in conformant if x["kind"] == "InferencePool"}
    assert check_routes(_by(conformant, "Gateway"), _by(conformant, "HTTPRoute"), pools) == []
    # the pool selects exactly the replica pods the baseline deploys
    pool = _by(conformant, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "kvlab",
                                                      "app.kubernetes.io/component": "replica"}


def test_crd_checks_can_fail(rendered):
    manifests = rendered["inference-pool"]
    services = {x["metadata"]["name"]: x for x in manifests if x["kind"] == "Service"}
    pool = _by(manifests, "InferencePool")
    for mutate in (lambda p: p["spec"].update(targetPortNumber=8000),              # the v1alpha2 field
                   lambda p: p["spec"]["targetPorts"].append({"number": 8001}),
                   lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Open"),
                   lambda p: p["spec"]["endpointPickerRef"]["port"].update(number=9999)):
        bad = copy.deepcopy(pool)
        mutate(bad)
        assert check_inference_pool(bad, services)
    route = copy.deepcopy(_by(manifests, "HTTPRoute"))
    route["spec"]["rules"][0]["backendRefs"][0]["kind"] = "Service"
    assert check_routes(_by(manifests, "Gateway"), route, {"kvlab-pool"})


def test_llm_d_plugin_config_is_consistent(rendered):
    cm = next(x for x in rendered["llm-d"] if x["metadata"]["name"].endswith("-plugins"))
    config = yaml.safe_load(cm["data"]["plugins.yaml"])
    assert config["apiVersion"] == llmd.CONFIG_API and config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = [r["pluginRef"] for prof in config["schedulingProfiles"] for r in prof["plugins"]]
    assert set(refs) <= declared and refs[-1] == "max-score-picker"
    scorers = {r["pluginRef"] for prof in config["schedulingProfiles"] for r in prof["plugins"] if "weight" in r}
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= scorers
    assert scorers & {"prefix-cache-scorer", "precise-prefix-cache-scorer"}
    picker = next(c for c in _by(rendered["llm-d"], "Deployment")["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "epp")
    assert picker["image"] == versions.LLMD_SCHEDULER_IMAGE and "--pool-name" in picker["args"]


def test_precise_scorer_only_on_gpu():
    assert "precise-prefix-cache-scorer" not in str(llmd.plugin_config(precise=False))
    precise = llmd.plugin_config(precise=True, block_size=16)
    plugin = next(p for p in precise["plugins"] if p["type"] == "precise-prefix-cache-scorer")
    assert plugin["parameters"]["tokenProcessorConfig"] == {"blockSize": 16, "hashSeed": llmd.KV_EVENTS_HASH_SEED}
    assert plugin["parameters"]["kvEventsConfig"] == {"topicFilter": "kv@", "discoverPods": True,
                                                      "podDiscoveryConfig": {"socketPort": o.KV_EVENTS_PORT}}


# ----------------------------------------------------------------------------- plans

def test_cluster_deploy_installs_crds_before_crd_objects():
    from kvlab.stack.kind import cli

    args = cli._parser().parse_args(["deploy", "llm-d", "inference-pool", "--no-build", "--dry-run"])
    steps = cli.build_plan(args)
    order = [s.action + ":" + (s.what if s.action != "rollout" else s.name or "") for s in steps]
    assert order == ["run:install CRDs", "run:install CRDs", "apply:llm-d", "rollout:kvlab-llm-d",
                     "run:install CRDs", "run:install CRDs", "apply:inference-pool", "rollout:kvlab-epp"]
    assert all(s.argv[:3] == ["kubectl", "--context", "kind-kvlab"] for s in steps if s.action == "run")


def test_lab_cluster_dry_run_plans_four_routers(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("dry-run must not run commands or reach a cluster")

    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(forward, "cluster_target", forbidden)
    import kvlab.stack.kind.caches as caches

    monkeypatch.setattr(caches, "core_api", forbidden)
    out = io.StringIO()
    console = lab.Console(file=out, width=300)
    monkeypatch.setattr(lab, "Console", lambda: console)
    assert lab.main(["--cluster", "--policies", "baseline,gateway-api,llm-d,kv-aware", "--dry-run"]) == 0
    text = out.getvalue()
    phase_lines = [line for line in text.splitlines() if line.startswith("phase ")]
    assert [line.split()[2].rstrip(":") for line in phase_lines] == [
        "baseline-service", "gateway-api-epp-kv-aware", "llm-d-scheduler", "gateway-kv-aware"]
    for line, target in zip(phase_lines, ("baseline", "gateway-api", "llm-d", "gateway")):
        assert f"http://127.0.0.1:{NODE_PORTS[target]}/v1" in line
    assert "kvlab cluster deploy observability baseline gateway-api llm-d gateway" in text
    assert text.index("gateway-api-inference-extension/releases") < text.index(": llm-d:")
    assert lab.main(["--cluster", "--policies", "baseline,random", "--dry-run"]) == 1
