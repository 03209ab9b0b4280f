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
from pathlib import Path
from typing import Any

import yaml

from kvlab.errors import ConfigError
from kvlab.stack.kind import gpu, versions
from kvlab.stack.kind import objects as o
from kvlab.stack.kind.observability import observability
from kvlab.stack.launch import gateway_args, sim_args
from kvlab.topology import Pool, Topology

# the last three: Envoy + endpoint pickers and the Inference Extension's CRD objects (stack/kind/phases.py)
PHASES = ("baseline", "gateway", "observability", "gateway-api", "llm-d", "inference-pool")

# ----------------------------------------------------------------------------- phases



def _sim_container(topology: Topology, pool: Pool, cluster: o.Cluster) -> dict[str, Any]:
    args = ["engine", "sim", "--replicas", "1", "--host", "0.0.0.0", "--ports", str(o.API_PORT),
            "--kv-events-ports", str(o.KV_EVENTS_PORT), "--name", "$(POD_NAME)", "--model", topology.model,
            *sim_args(topology.sim)]
    if pool.data_parallel_size > 1:
        args += ["--data-parallel-size", str(pool.data_parallel_size)]
    return {
        "name": "sim", "image": cluster.image, "imagePullPolicy": "IfNotPresent",
        "command": ["kvlab"], "args": args,
        "ports": _replica_ports(pool.data_parallel_size),
        "env": [o.field_env("POD_NAME", "metadata.name"), o.field_env("POD_NAMESPACE", "metadata.namespace"),
                {"name": "HOME", "value": "/tmp"}, *o.pod_otel_env(topology, f"kvlab-sim-{pool.name}", cluster.namespace)],
        "readinessProbe": o.http_probe("/health", "http", 2, 3),
        "livenessProbe": o.http_probe("/health", "http", 10, 6),
        "resources": o.resources("100m", "128Mi", "1", "512Mi"),
        "securityContext": o.container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def _replica_ports(dp: int) -> list[dict[str, Any]]:
    ports = []
    for rank in range(dp):
        suffix = "" if rank == 0 else f"-{rank}"
        ports.append({"name": f"http{suffix}", "containerPort": o.API_PORT + rank, "protocol": "TCP"})
        ports.append({"name": f"kv-events{suffix}"[:15], "containerPort": o.KV_EVENTS_PORT + rank, "protocol": "TCP"})
    return ports


def is_pd(topology: Topology) -> bool:
    """A P/D topology: some pool is a prefill or decode pool (docs/pd.md)."""
    return any(p.role != "both" for p in topology.pools)


def _nixl(topology: Topology, pool: Pool) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """(args, env, ports) a vLLM pod needs to hand over or receive KV in a P/D topology: every pool
    takes part (a `both` replica can be a split's decode side). The side channel is advertised on
    the pod IP (vLLM's default, localhost, is unreachable from the other pods). A user's own
    `--kv-transfer-config` in vllm.extra_args wins."""
    if not is_pd(topology):
        return [], [], []
    extra = topology.vllm.extra_args
    own = any(a == "--kv-transfer-config" or a.startswith(("--kv-transfer-config=", "--kv-transfer-config."))
              for a in extra)
    args = [] if own else ["--kv-transfer-config", o.NIXL_KV_TRANSFER_CONFIG]
    env = [o.field_env("VLLM_NIXL_SIDE_CHANNEL_HOST", "status.podIP"),
           {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(o.NIXL_SIDE_CHANNEL_PORT)}]
    ports = [{"name": "nixl" if rank == 0 else f"nixl-{rank}", "containerPort": o.NIXL_SIDE_CHANNEL_PORT + rank,
              "protocol": "TCP"} for rank in range(pool.data_parallel_size)]
    return args, env, ports


def _vllm_container(topology: Topology, pool: Pool, cluster: o.Cluster, rank: int = 0) -> dict[str, Any]:
    """The `vllm serve` of one data-parallel rank (the only one unless data_parallel_size > 1)."""
    v = topology.vllm
    # the topic and block hashes llm-d's precise scorer reads too (stack/kind/llmd.py); kvlab's gateway
    # subscribes to every topic, its index keys blocks by token ids, not by vLLM's hashes
    kv_events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                            "endpoint": f"tcp://*:{o.KV_EVENTS_PORT}", "topic": f"kv@$(POD_IP)@{topology.model}"},
                           separators=(",", ":"))
    own_algo = any(a.startswith("--prefix-caching-hash-algo") for a in v.extra_args)
    algo = [] if own_algo else ["--prefix-caching-hash-algo", o.KV_HASH_ALGO]
    args = [cluster.hf_model, "--host", "0.0.0.0", "--port", str(o.API_PORT + rank),
            "--served-model-name", topology.model, "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", str(v.max_model_len), *gpu.vllm_args(topology), *algo,
            "--kv-events-config", kv_events, *v.extra_args]
    nixl_args, nixl_env, nixl_ports = _nixl(topology, pool)
    args += nixl_args
    args += gpu.data_parallel_args(pool.data_parallel_size, rank)
    endpoint = o.otlp_endpoint(topology, cluster.namespace)
    if endpoint is not None:
        args += ["--otlp-traces-endpoint", endpoint.rstrip("/") + "/v1/traces", "--collect-detailed-traces", "all"]
    env = [
        o.field_env("POD_NAME", "metadata.name"), o.field_env("POD_NAMESPACE", "metadata.namespace"),
        o.field_env("POD_IP", "status.podIP"), {"name": "PYTHONHASHSEED", "value": o.KV_HASH_SEED},
        o.secret_env("HF_TOKEN", cluster.hf_token_secret, "token"),
        {"name": "HOME", "value": "/cache"}, {"name": "HF_HOME", "value": "/cache/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": "/cache"}, {"name": "VLLM_CACHE_ROOT", "value": "/cache/vllm"},
        {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"}, {"name": "TMPDIR", "value": "/tmp"},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"}, {"name": "DO_NOT_TRACK", "value": "1"},
        # enables POST /reset_prefix_cache (`kvlab lab --cluster` resets caches before each phase)
        {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
        *nixl_env, *o.pod_otel_env(topology, f"vllm-{pool.name}", cluster.namespace),
    ]
    ports = _replica_ports(pool.data_parallel_size)[2 * rank:2 * rank + 2] + nixl_ports[rank:rank + 1]
    http = ports[0]["name"]
    return {
        "name": "vllm" if pool.data_parallel_size == 1 else f"vllm-{rank}", "image": cluster.vllm_image, "imagePullPolicy": "IfNotPresent",
        "command": ["vllm", "serve"], "args": args,
        "ports": ports, "env": env,
        # the first start downloads the model: allow 20 minutes before liveness applies
        "startupProbe": o.http_probe("/health", http, 10, 120),
        "readinessProbe": o.http_probe("/health", http, 5, 3),
        "livenessProbe": o.http_probe("/health", http, 15, 4),
        "resources": o.resources("2", "8Gi", "8", "24Gi", **{"nvidia.com/gpu": str(cluster.gpus_per_replica)}),
        "securityContext": o.container_security(),
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }


def replica_deployment(topology: Topology, pool: Pool, cluster: o.Cluster) -> o.Manifest:
    o.check_name("pool name", pool.name)
    labels = o.labels("replica", **{o.POOL_LABEL: pool.name, o.ROLE_LABEL: pool.role})
    annotations = {**o.scrape_annotations(o.API_PORT), o.DP_SIZE_ANNOTATION: str(pool.data_parallel_size)}
    if cluster.gpu:
        containers = [_vllm_container(topology, pool, cluster, rank) for rank in range(pool.data_parallel_size)]
        volumes = [gpu.model_cache_volume(), o.empty_dir("tmp", "4Gi"), o.empty_dir("dshm", "2Gi", "Memory")]
        spec: dict[str, Any] = {"runtimeClassName": "nvidia", "nodeSelector": {o.GPU_NODE_LABEL: "true"},
                                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
        uid = 1000
    else:
        containers = [_sim_container(topology, pool, cluster)]
        volumes = [o.empty_dir("tmp")]
        spec, uid = {}, o.KVLAB_UID
    spec.update({
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": o.pod_security(uid),
        "terminationGracePeriodSeconds": 30,
        "containers": containers,
        "volumes": volumes,
    })
    return o.deployment(f"kvlab-{pool.name}", cluster.namespace, labels, pool.replicas, spec, annotations)


def baseline(topology: Topology, cluster: o.Cluster) -> list[o.Manifest]:
    """Replicas behind a plain Service: the cache-blind baseline (connection-level spreading)."""
    ns = cluster.namespace
    out = [o.namespace(cluster)]
    if cluster.gpu:
        out.append(gpu.model_cache_claim(ns))
    out += [replica_deployment(topology, pool, cluster) for pool in topology.pools]
    out.append(o.service("kvlab-baseline", ns, o.labels("baseline"), {o.PART_OF: "kvlab", o.COMPONENT: "replica"},
                        [{"name": "http", "port": o.API_PORT, "targetPort": "http", "protocol": "TCP",
                          "nodePort": o.NODE_PORTS["baseline"]}], node_port=True))
    return out


def _gateway_config_file(topology: Topology) -> Path | None:
    path = topology.gateway.config
    if path is None:
        return None
    candidates = [Path(path), o.REPO_ROOT / path]
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


def _gateway_config_map(topology: Topology, cluster: o.Cluster) -> o.Manifest | None:
    found = _gateway_config_file(topology)
    if found is None:
        return None
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": o.meta("kvlab-gateway-config", cluster.namespace, o.labels("gateway")),
            "data": {"gateway.yaml": found.read_text()}}


def gateway(topology: Topology, cluster: o.Cluster) -> list[o.Manifest]:
    """The KV-aware gateway, discovering replica pods through the API with least privilege."""
    ns = cluster.namespace
    labels = o.labels("gateway")
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": o.meta("kvlab-gateway", ns, labels),
          "automountServiceAccountToken": True}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": o.meta("kvlab-gateway", ns, labels),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                      {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": o.meta("kvlab-gateway", ns, labels),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kvlab-gateway"},
               "subjects": [{"kind": "ServiceAccount", "name": "kvlab-gateway", "namespace": ns}]}
    config_map = _gateway_config_map(topology, cluster)
    g = topology.gateway
    args = [*gateway_args(g, policy=g.policy, model=topology.model, host="0.0.0.0", port=o.API_PORT),
            "--discovery", "kubernetes", "--namespace", "$(POD_NAMESPACE)", "--selector", o.REPLICA_SELECTOR,
            "--replica-port", str(o.API_PORT), "--replica-kv-events-port", str(o.KV_EVENTS_PORT)]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes = [o.empty_dir("tmp")]
    init: list[dict[str, Any]] = []
    if config_map is not None:
        args += ["--config", "/etc/kvlab/gateway.yaml"]
        mounts.append({"name": "config", "mountPath": "/etc/kvlab", "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": "kvlab-gateway-config"}})
    if cluster.gpu:
        # vLLM tokenizes with the real model's tokenizer; the gateway must hash the same token ids
        args += ["--tokenizer", "/tokenizer"]
        mounts.append({"name": "tokenizer", "mountPath": "/tokenizer", "readOnly": True})
        volumes.append(o.empty_dir("tokenizer", "512Mi"))
        init.append({
            "name": "fetch-tokenizer", "image": cluster.image, "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-m", "kvlab.stack.kind.hub", cluster.hf_model, "/tokenizer"],
            "env": [o.secret_env("HF_TOKEN", cluster.hf_token_secret, "token"), {"name": "HOME", "value": "/tmp"},
                    {"name": "HF_HOME", "value": "/tmp/hf"}],
            "resources": o.resources("100m", "128Mi", "1", "512Mi"),
            "securityContext": o.container_security(),
            "volumeMounts": [{"name": "tokenizer", "mountPath": "/tokenizer"}, {"name": "tmp", "mountPath": "/tmp"}],
        })
    container = {
        "name": "gateway", "image": cluster.image, "imagePullPolicy": "IfNotPresent",
        "command": ["kvlab"], "args": args,
        "ports": [{"name": "http", "containerPort": o.API_PORT, "protocol": "TCP"}],
        "env": [o.field_env("POD_NAME", "metadata.name"), o.field_env("POD_NAMESPACE", "metadata.namespace"),
                {"name": "HOME", "value": "/tmp"}, *o.pod_otel_env(topology, "kvlab-gateway", ns)],
        "readinessProbe": o.http_probe("/health", "http", 2, 3),
        "livenessProbe": o.http_probe("/health", "http", 10, 6),
        "resources": o.resources("250m", "256Mi", "2", "1Gi"),
        "securityContext": o.container_security(),
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {
        "serviceAccountName": "kvlab-gateway",
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": o.pod_security(o.KVLAB_UID),
        "containers": [container],
        "volumes": volumes,
    }
    if init:
        spec["initContainers"] = init
    annotations = o.scrape_annotations(o.API_PORT)
    pd = gateway_pd(topology)
    if pd is not None:
        annotations[o.PD_ANNOTATION] = pd
    deployment = o.deployment("kvlab-gateway", ns, labels, 1, spec, annotations)
    service = o.service("kvlab-gateway", ns, labels, {o.PART_OF: "kvlab", o.COMPONENT: "gateway"},
                       [{"name": "http", "port": o.API_PORT, "targetPort": "http", "protocol": "TCP",
                         "nodePort": o.NODE_PORTS["gateway"]}], node_port=True)
    return [o.namespace(cluster), sa, role, binding, *([config_map] if config_map else []), deployment, service]

# ----------------------------------------------------------------------------- GPU plumbing

def gpu_support(replicas_per_gpu: int = 1) -> list[o.Manifest]:
    """The `nvidia` RuntimeClass and NVIDIA's device plugin (what nvkind's README installs with helm).

    The device plugin needs the kubelet's device-plugin socket directory (a hostPath), so it runs in
    its own namespace with the `privileged` Pod Security level; it still drops every capability.
    `replicas_per_gpu` > 1 adds the time-slicing config (gpu.time_slicing)."""
    ns = "nvidia-device-plugin"
    labels = {o.PART_OF: "kvlab", "app.kubernetes.io/name": "nvidia-device-plugin"}
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": "nvidia", "labels": {o.PART_OF: "kvlab"}}, "handler": "nvidia"}
    namespace_ = {"apiVersion": "v1", "kind": "Namespace",
                  "metadata": {"name": ns, "labels": {o.PART_OF: "kvlab", "pod-security.kubernetes.io/enforce": "privileged"}}}
    container: dict[str, Any] = {
        "name": "nvidia-device-plugin", "image": versions.NVIDIA_DEVICE_PLUGIN_IMAGE, "imagePullPolicy": "IfNotPresent",
        "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}, {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"},
                *([{"name": "CONFIG_FILE", "value": gpu.DEVICE_PLUGIN_CONFIG_PATH}] if replicas_per_gpu > 1 else [])],
        "resources": o.resources("50m", "64Mi", "500m", "256Mi"),
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"}],
    }
    volumes: list[dict[str, Any]] = [{"name": "device-plugin",
                                      "hostPath": {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"}}]
    extra: list[o.Manifest] = []
    if replicas_per_gpu > 1:
        extra.append(gpu.device_plugin_config(ns, labels, replicas_per_gpu))
        container["volumeMounts"].append({"name": "config", "mountPath": gpu.DEVICE_PLUGIN_CONFIG_PATH.rsplit("/", 1)[0],
                                          "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": gpu.DEVICE_PLUGIN_CONFIG}})
    daemonset = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": o.meta("nvidia-device-plugin", ns, labels),
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
                    "nodeSelector": {o.GPU_NODE_LABEL: "true"},
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    return [runtime_class, namespace_, *extra, daemonset]


# ----------------------------------------------------------------------------- entry points

def render(topology: Topology, cluster: o.Cluster) -> dict[str, list[o.Manifest]]:
    """Every phase's manifests, in apply order (`gpu` first on GPU clusters)."""
    o.check_name("namespace", cluster.namespace)
    phases: dict[str, list[o.Manifest]] = {}
    if cluster.gpu:
        phases["gpu"] = gpu_support(topology.gpu.replicas_per_gpu)
    phases["baseline"] = baseline(topology, cluster)
    phases["gateway"] = gateway(topology, cluster)
    phases["observability"] = observability(topology, cluster)
    return phases


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML has no stubs installed here
    """Plain YAML: no anchors/aliases even where a dict is shared between two places."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(manifests: list[o.Manifest]) -> str:
    """A multi-document YAML stream, as `kubectl apply -f -` takes it."""
    return str(yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False))
