"""Kubernetes manifests for the kind path, rendered from the same Topology as the local stack.

`render(topology, cluster)` returns the manifests of each deploy phase as plain dicts:

- `gpu` (GPU clusters only): the `nvidia` RuntimeClass and NVIDIA's device plugin;
- `baseline`: the namespace, one replica Deployment per pool (simulator on CPU, the official
  vLLM image on GPU) and the cache-blind Service `kvlab-baseline` (kube-proxy spreads
  connections over every replica, knowing nothing about caches);
- `gateway`: the instrumented gateway with Kubernetes discovery, its Service and least-privilege
  RBAC (get/list/watch pods and EndpointSlices of its namespace only);
- `observability`: Jaeger v2, Prometheus (pod discovery of replicas and gateway) and Grafana
  provisioned from `dashboards/`.

Secure defaults everywhere: the namespace enforces the `restricted` Pod Security Standard, every
container runs non-root with a read-only root filesystem (emptyDirs for writable paths), no
capabilities, RuntimeDefault seccomp, requests and limits. Secrets are only referenced (the HF
token, Grafana's admin password), never contained. Tests validate every manifest strictly with
kubernetes-validate against `versions.KUBERNETES_VERSION`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvlab import __version__
from kvlab.dashboards import rules
from kvlab.errors import ConfigError
from kvlab.stack.kind import gpu, versions
from kvlab.stack.launch import gateway_args, otel_env, sim_args
from kvlab.topology import Pool, Topology

Manifest = dict[str, Any]
# the last three: Envoy + endpoint pickers and the Inference Extension's CRD objects (stack/kind/phases.py)
PHASES = ("baseline", "gateway", "observability", "gateway-api", "llm-d", "inference-pool")

PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"
POOL_LABEL = "kvlab.io/pool"
ROLE_LABEL = "kvlab.io/role"        # read by gateway.discovery.kubernetes
DP_SIZE_ANNOTATION = "kvlab.io/data-parallel-size"
GPU_NODE_LABEL = "kvlab.io/gpu"      # set on GPU workers by kind/gpu.yaml
REPLICA_SELECTOR = f"{PART_OF}=kvlab,{COMPONENT}=replica"

API_PORT = 8000
KV_EVENTS_PORT = 5557
# block hashes llm-d's precise scorer can recompute (stack/kind/llmd.py): vLLM's CBOR SHA-256, seeded
KV_HASH_ALGO = "sha256_cbor"
KV_HASH_SEED = "42"   # PYTHONHASHSEED of the vLLM pods = the scorer's tokenProcessorConfig.hashSeed
# NodePorts, mapped to the same ports on 127.0.0.1 of the host by kind/*.yaml (extraPortMappings).
NODE_PORTS = {"baseline": 30080, "gateway": 30081, "jaeger": 30686, "prometheus": 30090, "grafana": 30300,
              "gateway-api": 30082, "llm-d": 30083}

KVLAB_UID = 10001                   # the user of kind/images/Dockerfile
# P/D on GPU: vLLM's NixlConnector (docs/pd.md). kv_both on every pool: NixlConnector ignores the
# role, the gateway decides who prefills; the side channel is the NIXL handshake port (+ DP rank).
NIXL_KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":"))
NIXL_SIDE_CHANNEL_PORT = 5600
PD_ANNOTATION = "kvlab.io/pd"       # on the gateway pod: the resolved split rule of its policy
REPO_ROOT = Path(__file__).resolve().parents[4]
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class Cluster(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how the topology runs in kind (the topology says what runs)."""

    name: str = "kvlab"                       # kind cluster name; kube context is kind-<name>
    namespace: str = "kvlab"
    gpu: bool = False                         # replicas run vLLM on NVIDIA GPUs instead of the simulator
    image: str = f"kvlab:{__version__}"       # gateway + simulator image (kind/images/Dockerfile)
    vllm_image: str = versions.VLLM_IMAGE
    hf_model: str = versions.VLLM_MODEL       # served under the topology's model name
    hf_token_secret: str = "hf-token"         # a Secret the user creates (key `token`); optional
    gpus_per_replica: int = 1
    dashboards_dir: Path = REPO_ROOT / "dashboards"

    @property
    def context(self) -> str:
        return f"kind-{self.name}"


# ----------------------------------------------------------------------------- building blocks

def _labels(component: str, **extra: str) -> dict[str, str]:
    return {PART_OF: "kvlab", COMPONENT: component, "app.kubernetes.io/name": f"kvlab-{component}", **extra}


def _meta(name: str, ns: str | None, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if ns:
        meta["namespace"] = ns
    if annotations:
        meta["annotations"] = annotations
    return meta


def _container_security() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_security(uid: int) -> dict:
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _resources(cpu: str, memory: str, cpu_limit: str, memory_limit: str, **extra_limits: str) -> dict:
    return {"requests": {"cpu": cpu, "memory": memory},
            "limits": {"cpu": cpu_limit, "memory": memory_limit, **extra_limits}}


def _empty_dir(name: str, size: str = "256Mi", medium: str | None = None) -> dict:
    spec: dict[str, Any] = {"sizeLimit": size}
    if medium:
        spec["medium"] = medium
    return {"name": name, "emptyDir": spec}


def _http_probe(path: str, port: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 2}


def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(name: str, secret: str, key: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}


def _deployment(name: str, ns: str, labels: dict[str, str], replicas: int, pod_spec: dict,
                annotations: dict[str, str] | None = None) -> Manifest:
    selector = {k: v for k, v in labels.items() if k in (PART_OF, COMPONENT, POOL_LABEL)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(name, ns, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {"metadata": _meta_template(labels, annotations), "spec": pod_spec},
        },
    }


def _meta_template(labels: dict[str, str], annotations: dict[str, str] | None) -> dict:
    meta: dict[str, Any] = {"labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return meta


def _service(name: str, ns: str, labels: dict[str, str], selector: dict[str, str], ports: list[dict],
             node_port: bool = False) -> Manifest:
    spec: dict[str, Any] = {"selector": selector, "ports": ports}
    spec["type"] = "NodePort" if node_port else "ClusterIP"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, ns, labels), "spec": spec}


def _scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _otel_env(topology: Topology, service: str, ns: str) -> list[dict]:
    """OTLP/HTTP to the in-cluster Jaeger (or the topology's own endpoint); nothing when traces are off."""
    endpoint = otlp_endpoint(topology, ns)
    if endpoint is None:
        return [{"name": "OTEL_TRACES_EXPORTER", "value": "none"}]
    env = otel_env(service, endpoint, topology.observability.sample_ratio) | {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",   # vLLM reads this one
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)",
    }
    return [{"name": k, "value": v} for k, v in env.items()]


def otlp_endpoint(topology: Topology, ns: str) -> str | None:
    """Where pods send traces: `off` -> None, a URL -> that URL, otherwise the in-cluster Jaeger."""
    traces = topology.observability.traces
    if traces == "off":
        return None
    if traces.startswith(("http://", "https://")):
        return traces
    return f"http://kvlab-jaeger.{ns}.svc:4318"


def _check_name(what: str, name: str) -> None:
    if not _DNS_LABEL.match(name) or len(name) > 40:
        raise ConfigError(f"kind: {what} {name!r} must be a DNS label (lowercase letters, digits, '-'; <= 40 chars)")


# ----------------------------------------------------------------------------- phases

def namespace(cluster: Cluster) -> Manifest:
    """The lab namespace; Pod Security `restricted` is enforced, so a weaker pod is refused."""
    labels = {PART_OF: "kvlab", "pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": cluster.namespace, "labels": labels}}


def _sim_container(topology: Topology, pool: Pool, cluster: Cluster) -> dict:
    args = ["engine", "sim", "--replicas", "1", "--host", "0.0.0.0", "--ports", str(API_PORT),
            "--kv-events-ports", str(KV_EVENTS_PORT), "--name", "$(POD_NAME)", "--model", topology.model,
            *sim_args(topology.sim)]
    if pool.data_parallel_size > 1:
        args += ["--data-parallel-size", str(pool.data_parallel_size)]
    return {
        "name": "sim", "image": cluster.image, "imagePullPolicy": "IfNotPresent",
        "command": ["kvlab"], "args": args,
        "ports": _replica_ports(pool.data_parallel_size),
        "env": [_field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace"),
                {"name": "HOME", "value": "/tmp"}, *_otel_env(topology, f"kvlab-sim-{pool.name}", cluster.namespace)],
        "readinessProbe": _http_probe("/health", "http", 2, 3),
        "livenessProbe": _http_probe("/health", "http", 10, 6),
        "resources": _resources("100m", "128Mi", "1", "512Mi"),
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def _replica_ports(dp: int) -> list[dict]:
    ports = []
    for rank in range(dp):
        suffix = "" if rank == 0 else f"-{rank}"
        ports.append({"name": f"http{suffix}", "containerPort": API_PORT + rank, "protocol": "TCP"})
        ports.append({"name": f"kv-events{suffix}"[:15], "containerPort": KV_EVENTS_PORT + rank, "protocol": "TCP"})
    return ports


def is_pd(topology: Topology) -> bool:
    """A P/D topology: some pool is a prefill or decode pool (docs/pd.md)."""
    return any(p.role != "both" for p in topology.pools)


def _nixl(topology: Topology, pool: Pool) -> tuple[list[str], list[dict], list[dict]]:
    """(args, env, ports) a vLLM pod needs to hand over or receive KV in a P/D topology: every pool
    takes part (a `both` replica can be a split's decode side). The side channel is advertised on
    the pod IP (vLLM's default, localhost, is unreachable from the other pods). A user's own
    `--kv-transfer-config` in vllm.extra_args wins."""
    if not is_pd(topology):
        return [], [], []
    extra = topology.vllm.extra_args
    own = any(a == "--kv-transfer-config" or a.startswith(("--kv-transfer-config=", "--kv-transfer-config."))
              for a in extra)
    args = [] if own else ["--kv-transfer-config", NIXL_KV_TRANSFER_CONFIG]
    env = [_field_env("VLLM_NIXL_SIDE_CHANNEL_HOST", "status.podIP"),
           {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(NIXL_SIDE_CHANNEL_PORT)}]
    ports = [{"name": "nixl" if rank == 0 else f"nixl-{rank}", "containerPort": NIXL_SIDE_CHANNEL_PORT + rank,
              "protocol": "TCP"} for rank in range(pool.data_parallel_size)]
    return args, env, ports


def _vllm_container(topology: Topology, pool: Pool, cluster: Cluster, rank: int = 0) -> dict:
    """The `vllm serve` of one data-parallel rank (the only one unless data_parallel_size > 1)."""
    v = topology.vllm
    # the topic and block hashes llm-d's precise scorer reads too (stack/kind/llmd.py); kvlab's gateway
    # subscribes to every topic, its index keys blocks by token ids, not by vLLM's hashes
    kv_events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                            "endpoint": f"tcp://*:{KV_EVENTS_PORT}", "topic": f"kv@$(POD_IP)@{topology.model}"},
                           separators=(",", ":"))
    own_algo = any(a.startswith("--prefix-caching-hash-algo") for a in v.extra_args)
    algo = [] if own_algo else ["--prefix-caching-hash-algo", KV_HASH_ALGO]
    args = [cluster.hf_model, "--host", "0.0.0.0", "--port", str(API_PORT + rank),
            "--served-model-name", topology.model, "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", str(v.max_model_len), *gpu.vllm_args(topology), *algo,
            "--kv-events-config", kv_events, *v.extra_args]
    nixl_args, nixl_env, nixl_ports = _nixl(topology, pool)
    args += nixl_args
    args += gpu.data_parallel_args(pool.data_parallel_size, rank)
    endpoint = otlp_endpoint(topology, cluster.namespace)
    if endpoint is not None:
        args += ["--otlp-traces-endpoint", endpoint.rstrip("/") + "/v1/traces", "--collect-detailed-traces", "all"]
    env = [
        _field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"), {"name": "PYTHONHASHSEED", "value": KV_HASH_SEED},
        _secret_env("HF_TOKEN", cluster.hf_token_secret, "token"),
        {"name": "HOME", "value": "/cache"}, {"name": "HF_HOME", "value": "/cache/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": "/cache"}, {"name": "VLLM_CACHE_ROOT", "value": "/cache/vllm"},
        {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"}, {"name": "TMPDIR", "value": "/tmp"},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"}, {"name": "DO_NOT_TRACK", "value": "1"},
        # enables POST /reset_prefix_cache (`kvlab lab --cluster` resets caches before each phase)
        {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
        *nixl_env, *_otel_env(topology, f"vllm-{pool.name}", cluster.namespace),
    ]
    ports = _replica_ports(pool.data_parallel_size)[2 * rank:2 * rank + 2] + nixl_ports[rank:rank + 1]
    http = ports[0]["name"]
    return {
        "name": "vllm" if pool.data_parallel_size == 1 else f"vllm-{rank}", "image": cluster.vllm_image, "imagePullPolicy": "IfNotPresent",
        "command": ["vllm", "serve"], "args": args,
        "ports": ports, "env": env,
        # the first start downloads the model: allow 20 minutes before liveness applies
        "startupProbe": _http_probe("/health", http, 10, 120),
        "readinessProbe": _http_probe("/health", http, 5, 3),
        "livenessProbe": _http_probe("/health", http, 15, 4),
        "resources": _resources("2", "8Gi", "8", "24Gi", **{"nvidia.com/gpu": str(cluster.gpus_per_replica)}),
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }


def replica_deployment(topology: Topology, pool: Pool, cluster: Cluster) -> Manifest:
    _check_name("pool name", pool.name)
    labels = _labels("replica", **{POOL_LABEL: pool.name, ROLE_LABEL: pool.role})
    annotations = {**_scrape_annotations(API_PORT), DP_SIZE_ANNOTATION: str(pool.data_parallel_size)}
    if cluster.gpu:
        containers = [_vllm_container(topology, pool, cluster, rank) for rank in range(pool.data_parallel_size)]
        volumes = [gpu.model_cache_volume(), _empty_dir("tmp", "4Gi"), _empty_dir("dshm", "2Gi", "Memory")]
        spec: dict[str, Any] = {"runtimeClassName": "nvidia", "nodeSelector": {GPU_NODE_LABEL: "true"},
                                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
        uid = 1000
    else:
        containers = [_sim_container(topology, pool, cluster)]
        volumes = [_empty_dir("tmp")]
        spec, uid = {}, KVLAB_UID
    spec.update({
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(uid),
        "terminationGracePeriodSeconds": 30,
        "containers": containers,
        "volumes": volumes,
    })
    return _deployment(f"kvlab-{pool.name}", cluster.namespace, labels, pool.replicas, spec, annotations)


def baseline(topology: Topology, cluster: Cluster) -> list[Manifest]:
    """Replicas behind a plain Service: the cache-blind baseline (connection-level spreading)."""
    ns = cluster.namespace
    out = [namespace(cluster)]
    if cluster.gpu:
        out.append(gpu.model_cache_claim(ns))
    out += [replica_deployment(topology, pool, cluster) for pool in topology.pools]
    out.append(_service("kvlab-baseline", ns, _labels("baseline"), {PART_OF: "kvlab", COMPONENT: "replica"},
                        [{"name": "http", "port": API_PORT, "targetPort": "http", "protocol": "TCP",
                          "nodePort": NODE_PORTS["baseline"]}], node_port=True))
    return out


def _gateway_config_file(topology: Topology) -> Path | None:
    path = topology.gateway.config
    if path is None:
        return None
    candidates = [Path(path), REPO_ROOT / path]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise ConfigError(f"kind: gateway config {path!r} not found (relative paths are read from the repo root)")
    return found


def gateway_pd(topology: Topology) -> str | None:
    """The gateway's P/D rule for a P/D topology, resolved from its policy and config file the way
    the gateway resolves them (`split at N uncached tokens` or `off`); None when no pool is P/D.
    A topology whose pools can only prefill is refused: nothing could decode."""
    if not is_pd(topology):
        return None
    if all(p.role == "prefill" for p in topology.pools):
        raise ConfigError("kind: a P/D topology needs a decode (or both) pool next to its prefill pool")
    from kvlab.gateway.config import load_policy

    pd = load_policy(topology.gateway.policy, _gateway_config_file(topology)).pd
    return f"split at {pd.threshold_tokens} uncached tokens" if pd.enabled else "off"


def _gateway_config_map(topology: Topology, cluster: Cluster) -> Manifest | None:
    found = _gateway_config_file(topology)
    if found is None:
        return None
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta("kvlab-gateway-config", cluster.namespace, _labels("gateway")),
            "data": {"gateway.yaml": found.read_text()}}


def gateway(topology: Topology, cluster: Cluster) -> list[Manifest]:
    """The KV-aware gateway, discovering replica pods through the API with least privilege."""
    ns = cluster.namespace
    labels = _labels("gateway")
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta("kvlab-gateway", ns, labels),
          "automountServiceAccountToken": True}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta("kvlab-gateway", ns, labels),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                      {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta("kvlab-gateway", ns, labels),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kvlab-gateway"},
               "subjects": [{"kind": "ServiceAccount", "name": "kvlab-gateway", "namespace": ns}]}
    config_map = _gateway_config_map(topology, cluster)
    g = topology.gateway
    args = [*gateway_args(g, policy=g.policy, model=topology.model, host="0.0.0.0", port=API_PORT),
            "--discovery", "kubernetes", "--namespace", "$(POD_NAMESPACE)", "--selector", REPLICA_SELECTOR,
            "--replica-port", str(API_PORT), "--replica-kv-events-port", str(KV_EVENTS_PORT)]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes = [_empty_dir("tmp")]
    init: list[dict] = []
    if config_map is not None:
        args += ["--config", "/etc/kvlab/gateway.yaml"]
        mounts.append({"name": "config", "mountPath": "/etc/kvlab", "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": "kvlab-gateway-config"}})
    if cluster.gpu:
        # vLLM tokenizes with the real model's tokenizer; the gateway must hash the same token ids
        args += ["--tokenizer", "/tokenizer"]
        mounts.append({"name": "tokenizer", "mountPath": "/tokenizer", "readOnly": True})
        volumes.append(_empty_dir("tokenizer", "512Mi"))
        init.append({
            "name": "fetch-tokenizer", "image": cluster.image, "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-m", "kvlab.stack.kind.hub", cluster.hf_model, "/tokenizer"],
            "env": [_secret_env("HF_TOKEN", cluster.hf_token_secret, "token"), {"name": "HOME", "value": "/tmp"},
                    {"name": "HF_HOME", "value": "/tmp/hf"}],
            "resources": _resources("100m", "128Mi", "1", "512Mi"),
            "securityContext": _container_security(),
            "volumeMounts": [{"name": "tokenizer", "mountPath": "/tokenizer"}, {"name": "tmp", "mountPath": "/tmp"}],
        })
    container = {
        "name": "gateway", "image": cluster.image, "imagePullPolicy": "IfNotPresent",
        "command": ["kvlab"], "args": args,
        "ports": [{"name": "http", "containerPort": API_PORT, "protocol": "TCP"}],
        "env": [_field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace"),
                {"name": "HOME", "value": "/tmp"}, *_otel_env(topology, "kvlab-gateway", ns)],
        "readinessProbe": _http_probe("/health", "http", 2, 3),
        "livenessProbe": _http_probe("/health", "http", 10, 6),
        "resources": _resources("250m", "256Mi", "2", "1Gi"),
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {
        "serviceAccountName": "kvlab-gateway",
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": _pod_security(KVLAB_UID),
        "containers": [container],
        "volumes": volumes,
    }
    if init:
        spec["initContainers"] = init
    annotations = _scrape_annotations(API_PORT)
    pd = gateway_pd(topology)
    if pd is not None:
        annotations[PD_ANNOTATION] = pd
    deployment = _deployment("kvlab-gateway", ns, labels, 1, spec, annotations)
    service = _service("kvlab-gateway", ns, labels, {PART_OF: "kvlab", COMPONENT: "gateway"},
                       [{"name": "http", "port": API_PORT, "targetPort": "http", "protocol": "TCP",
                         "nodePort": NODE_PORTS["gateway"]}], node_port=True)
    return [namespace(cluster), sa, role, binding, *([config_map] if config_map else []), deployment, service]


# ----------------------------------------------------------------------------- observability

def _jaeger(cluster: Cluster) -> list[Manifest]:
    ns, labels = cluster.namespace, _labels("jaeger")
    container = {
        "name": "jaeger", "image": versions.JAEGER_IMAGE, "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "otlp-grpc", "containerPort": 4317, "protocol": "TCP"},
                  {"name": "otlp-http", "containerPort": 4318, "protocol": "TCP"},
                  {"name": "ui", "containerPort": 16686, "protocol": "TCP"}],
        "readinessProbe": _http_probe("/", "ui", 5, 3),
        "resources": _resources("100m", "256Mi", "1", "1Gi"),
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    spec = {"automountServiceAccountToken": False, "enableServiceLinks": False,
            "securityContext": _pod_security(10001), "containers": [container], "volumes": [_empty_dir("tmp")]}
    ports = [{"name": "otlp-grpc", "port": 4317, "targetPort": "otlp-grpc", "protocol": "TCP"},
             {"name": "otlp-http", "port": 4318, "targetPort": "otlp-http", "protocol": "TCP"},
             {"name": "ui", "port": 16686, "targetPort": "ui", "protocol": "TCP", "nodePort": NODE_PORTS["jaeger"]}]
    return [_deployment("kvlab-jaeger", ns, labels, 1, spec),
            _service("kvlab-jaeger", ns, labels, {PART_OF: "kvlab", COMPONENT: "jaeger"}, ports, node_port=True)]


def _scrape_job(job: str, component: str, ns: str, interval: str) -> dict:
    return {
        "job_name": job,
        "scrape_interval": interval,
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [ns]},
                                   "selectors": [{"role": "pod", "label": f"{COMPONENT}={component}"}]}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "regex": "true",
             "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "http", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"], "regex": "(.+)",
             "target_label": "__metrics_path__"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_label_kvlab_io_pool"], "target_label": "pool"},
            {"source_labels": ["__meta_kubernetes_pod_label_kvlab_io_role"], "target_label": "role"},
        ],
    }


def prometheus_config(cluster: Cluster, interval: str = "2s") -> dict:
    """Jobs `replicas` and `gateway`, the same job names as the local stack's Prometheus, and the
    lab's rules (kvlab.dashboards.rules, mounted from the same ConfigMap)."""
    ns = cluster.namespace
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": ["/etc/prometheus/kvlab.rules.yaml"],
            "scrape_configs": [_scrape_job("replicas", "replica", ns, interval),
                               _scrape_job("gateway", "gateway", ns, interval)]}


def _prometheus(cluster: Cluster) -> list[Manifest]:
    ns, labels = cluster.namespace, _labels("prometheus")
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta("kvlab-prometheus", ns, labels),
              "data": {"prometheus.yml": yaml.safe_dump(prometheus_config(cluster), sort_keys=False),
                       "kvlab.rules.yaml": rules.render()}}
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta("kvlab-prometheus", ns, labels),
          "automountServiceAccountToken": True}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta("kvlab-prometheus", ns, labels),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta("kvlab-prometheus", ns, labels),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kvlab-prometheus"},
               "subjects": [{"kind": "ServiceAccount", "name": "kvlab-prometheus", "namespace": ns}]}
    container = {
        "name": "prometheus", "image": versions.PROMETHEUS_IMAGE, "imagePullPolicy": "IfNotPresent",
        "args": ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus",
                 "--storage.tsdb.retention.time=2d"],
        "ports": [{"name": "web", "containerPort": 9090, "protocol": "TCP"}],
        "readinessProbe": _http_probe("/-/ready", "web", 5, 3),
        "livenessProbe": _http_probe("/-/healthy", "web", 15, 4),
        "resources": _resources("100m", "256Mi", "1", "2Gi"),
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "config", "mountPath": "/etc/prometheus", "readOnly": True},
                         {"name": "data", "mountPath": "/prometheus"}],
    }
    spec = {"serviceAccountName": "kvlab-prometheus", "automountServiceAccountToken": True,
            "enableServiceLinks": False, "securityContext": _pod_security(65534), "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": "kvlab-prometheus"}}, _empty_dir("data", "4Gi")]}
    deployment = _deployment("kvlab-prometheus", ns, labels, 1, spec,
                             {"kvlab.io/config-sha": _digest(config["data"])})
    service = _service("kvlab-prometheus", ns, labels, {PART_OF: "kvlab", COMPONENT: "prometheus"},
                       [{"name": "web", "port": 9090, "targetPort": "web", "protocol": "TCP",
                         "nodePort": NODE_PORTS["prometheus"]}], node_port=True)
    return [config, sa, role, binding, deployment, service]


def _digest(data: dict[str, str]) -> str:
    """A short content hash on the pod template, so a changed ConfigMap rolls the pods."""
    import hashlib

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def grafana_datasources(cluster: Cluster) -> dict:
    """Datasources for Grafana in the cluster: the observability part's provisioning file when it
    exists (so the uids its dashboards reference match), with URLs pointed at the in-cluster services."""
    ns = cluster.namespace
    urls = {"prometheus": f"http://kvlab-prometheus.{ns}.svc:9090", "jaeger": f"http://kvlab-jaeger.{ns}.svc:16686"}
    found: list[dict] = []
    for path in sorted((cluster.dashboards_dir / "provisioning").glob("datasources/*.y*ml")):
        data = yaml.safe_load(path.read_text()) or {}
        found += [dict(ds) for ds in data.get("datasources", []) if ds.get("type") in urls]
    if not found:
        found = [{"name": "Prometheus", "type": "prometheus", "uid": "prometheus", "isDefault": True},
                 {"name": "Jaeger", "type": "jaeger", "uid": "jaeger"}]
    for ds in found:
        ds["url"] = urls[ds["type"]]
        ds["access"] = "proxy"
        ds["editable"] = False
    return {"apiVersion": 1, "datasources": found}


def grafana_dashboards(cluster: Cluster) -> dict[str, str]:
    """Dashboard JSON files from dashboards/ (file name -> text); empty when none are written yet."""
    out: dict[str, str] = {}
    for path in sorted(cluster.dashboards_dir.glob("*.json")):
        text = path.read_text()
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from None
        out[path.name] = text
    if sum(len(t) for t in out.values()) > 900_000:
        raise ConfigError(f"{cluster.dashboards_dir}: dashboards exceed a ConfigMap's 1 MiB; split them")
    return out


def _grafana(cluster: Cluster) -> list[Manifest]:
    ns, labels = cluster.namespace, _labels("grafana")
    provider = {"apiVersion": 1, "providers": [{
        "name": "kvlab", "folder": "kvlab", "type": "file", "disableDeletion": True, "allowUiUpdates": False,
        "updateIntervalSeconds": 30, "options": {"path": "/etc/kvlab/dashboards", "foldersFromFilesStructure": False}}]}
    maps = {
        "kvlab-grafana-datasources": {"datasources.yaml": yaml.safe_dump(grafana_datasources(cluster), sort_keys=False)},
        "kvlab-grafana-providers": {"kvlab.yaml": yaml.safe_dump(provider, sort_keys=False)},
        "kvlab-grafana-dashboards": grafana_dashboards(cluster),
    }
    config_maps = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(name, ns, labels), "data": data}
                   for name, data in maps.items()]
    env = [
        {"name": "GF_AUTH_ANONYMOUS_ENABLED", "value": "true"},
        {"name": "GF_AUTH_ANONYMOUS_ORG_ROLE", "value": "Viewer"},
        {"name": "GF_SECURITY_ADMIN_USER", "value": "admin"},
        _secret_env("GF_SECURITY_ADMIN_PASSWORD", "kvlab-grafana", "admin-password"),
        {"name": "GF_ANALYTICS_REPORTING_ENABLED", "value": "false"},
        {"name": "GF_ANALYTICS_CHECK_FOR_UPDATES", "value": "false"},
        {"name": "GF_PLUGINS_PREINSTALL_DISABLED", "value": "true"},
        {"name": "GF_PATHS_DATA", "value": "/var/lib/grafana"},
        {"name": "GF_PATHS_LOGS", "value": "/var/log/grafana"},
        {"name": "GF_PATHS_PROVISIONING", "value": "/etc/grafana/provisioning"},
    ]
    container = {
        "name": "grafana", "image": versions.GRAFANA_IMAGE, "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "web", "containerPort": 3000, "protocol": "TCP"}],
        "env": env,
        "readinessProbe": _http_probe("/api/health", "web", 5, 3),
        "resources": _resources("100m", "256Mi", "1", "1Gi"),
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "datasources", "mountPath": "/etc/grafana/provisioning/datasources", "readOnly": True},
            {"name": "providers", "mountPath": "/etc/grafana/provisioning/dashboards", "readOnly": True},
            {"name": "dashboards", "mountPath": "/etc/kvlab/dashboards", "readOnly": True},
            {"name": "data", "mountPath": "/var/lib/grafana"},
            {"name": "logs", "mountPath": "/var/log/grafana"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    volumes = [{"name": "datasources", "configMap": {"name": "kvlab-grafana-datasources"}},
               {"name": "providers", "configMap": {"name": "kvlab-grafana-providers"}},
               {"name": "dashboards", "configMap": {"name": "kvlab-grafana-dashboards"}},
               _empty_dir("data", "1Gi"), _empty_dir("logs", "256Mi"), _empty_dir("tmp")]
    spec = {"automountServiceAccountToken": False, "enableServiceLinks": False,
            "securityContext": _pod_security(472), "containers": [container], "volumes": volumes}
    sha = _digest({k: v for m in config_maps for k, v in m["data"].items()})
    deployment = _deployment("kvlab-grafana", ns, labels, 1, spec, {"kvlab.io/config-sha": sha})
    service = _service("kvlab-grafana", ns, labels, {PART_OF: "kvlab", COMPONENT: "grafana"},
                       [{"name": "web", "port": 3000, "targetPort": "web", "protocol": "TCP",
                         "nodePort": NODE_PORTS["grafana"]}], node_port=True)
    return [*config_maps, deployment, service]


def observability(topology: Topology, cluster: Cluster) -> list[Manifest]:
    """Jaeger (unless traces are off or go elsewhere), Prometheus and Grafana (unless prometheus: off)."""
    out = [namespace(cluster)]
    if otlp_endpoint(topology, cluster.namespace) == f"http://kvlab-jaeger.{cluster.namespace}.svc:4318":
        out += _jaeger(cluster)
    if topology.observability.prometheus != "off":
        out += _prometheus(cluster) + _grafana(cluster)
    return out


# ----------------------------------------------------------------------------- GPU plumbing

def gpu_support(replicas_per_gpu: int = 1) -> list[Manifest]:
    """The `nvidia` RuntimeClass and NVIDIA's device plugin (what nvkind's README installs with helm).

    The device plugin needs the kubelet's device-plugin socket directory (a hostPath), so it runs in
    its own namespace with the `privileged` Pod Security level; it still drops every capability.
    `replicas_per_gpu` > 1 adds the time-slicing config (gpu.time_slicing)."""
    ns = "nvidia-device-plugin"
    labels = {PART_OF: "kvlab", "app.kubernetes.io/name": "nvidia-device-plugin"}
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": "nvidia", "labels": {PART_OF: "kvlab"}}, "handler": "nvidia"}
    namespace_ = {"apiVersion": "v1", "kind": "Namespace",
                  "metadata": {"name": ns, "labels": {PART_OF: "kvlab", "pod-security.kubernetes.io/enforce": "privileged"}}}
    container = {
        "name": "nvidia-device-plugin", "image": versions.NVIDIA_DEVICE_PLUGIN_IMAGE, "imagePullPolicy": "IfNotPresent",
        "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}, {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"},
                *([{"name": "CONFIG_FILE", "value": gpu.DEVICE_PLUGIN_CONFIG_PATH}] if replicas_per_gpu > 1 else [])],
        "resources": _resources("50m", "64Mi", "500m", "256Mi"),
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"}],
    }
    volumes: list[dict] = [{"name": "device-plugin",
                            "hostPath": {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"}}]
    extra: list[Manifest] = []
    if replicas_per_gpu > 1:
        extra.append(gpu.device_plugin_config(ns, labels, replicas_per_gpu))
        container["volumeMounts"].append({"name": "config", "mountPath": gpu.DEVICE_PLUGIN_CONFIG_PATH.rsplit("/", 1)[0],
                                          "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": gpu.DEVICE_PLUGIN_CONFIG}})
    daemonset = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": _meta("nvidia-device-plugin", ns, labels),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": "nvidia-device-plugin"}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "runtimeClassName": "nvidia",
                    "priorityClassName": "system-node-critical",
                    "automountServiceAccountToken": False,
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                    {"key": "CriticalAddonsOnly", "operator": "Exists"}],
                    "nodeSelector": {GPU_NODE_LABEL: "true"},
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    return [runtime_class, namespace_, *extra, daemonset]


# ----------------------------------------------------------------------------- entry points

def render(topology: Topology, cluster: Cluster) -> dict[str, list[Manifest]]:
    """Every phase's manifests, in apply order (`gpu` first on GPU clusters)."""
    _check_name("namespace", cluster.namespace)
    phases: dict[str, list[Manifest]] = {}
    if cluster.gpu:
        phases["gpu"] = gpu_support(topology.gpu.replicas_per_gpu)
    phases["baseline"] = baseline(topology, cluster)
    phases["gateway"] = gateway(topology, cluster)
    phases["observability"] = observability(topology, cluster)
    return phases


class _Dumper(yaml.SafeDumper):
    """Plain YAML: no anchors/aliases even where a dict is shared between two places."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(manifests: list[Manifest]) -> str:
    """A multi-document YAML stream, as `kubectl apply -f -` takes it."""
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
