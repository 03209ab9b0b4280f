"""Phase `llm-d`: llm-d's inference scheduler (its published image and plugin config) on the same
replicas, in the same standalone layout as `gateway-api` (Envoy beside the picker, gatewayapi.py).

llm-d's picker is an Inference Extension endpoint picker: it reads its pool from an
`InferencePool` object (so the Inference Extension CRD must be installed, gatewayapi.CRD_INSTALL)
and scores pods by scraping their vLLM metrics. On simulator replicas the plugin set is the
approximate one: `prefix-cache-scorer` (prefixes it routed, learned per pod), `queue-scorer`
(`vllm:num_requests_waiting`) and `kv-cache-utilization-scorer` (`vllm:kv_cache_usage_perc`),
which the simulator exports under vLLM's names. On GPU clusters the config also carries the precise
scorer, which subscribes to the engines' KV events (docs/gateway-api.md says what vLLM must send).
"""

from __future__ import annotations

from typing import Any

import yaml

from kvlab.stack.kind import envoy, gatewayapi, versions
from kvlab.stack.kind import objects as o
from kvlab.topology import Topology

Manifest = dict[str, Any]
NAME = "kvlab-llm-d"
POOL = "kvlab-pool"
HEALTH_PORT = 9003
LLMD_UID = 65532            # the distroless `nonroot` user of the llm-d and Envoy images
# What llm-d's precise scorer needs from the vLLM pods (rendered by manifests.py for vLLM pods on GPU):
# block hashes it can recompute (vLLM `--prefix-caching-hash-algo sha256_cbor`, seeded by PYTHONHASHSEED =
# its tokenProcessorConfig.hashSeed), the same block size, and KV events on a topic
# `kv@<pod-ip>@<model>` at the pod's port KV_EVENTS_PORT + rank (it subscribes to every pod it discovers).
KV_EVENTS_HASH_SEED = o.KV_HASH_SEED
CONFIG_API = "inference.networking.x-k8s.io/v1alpha1"


def plugin_config(precise: bool, block_size: int = 16) -> dict[str, Any]:
    """The EndpointPickerConfig: approximate prefix + queue + KV-usage scorers, max-score picker."""
    plugins: list[dict[str, Any]] = [{"type": "single-profile-handler"}, {"type": "prefix-cache-scorer"},
                                     {"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                                     {"type": "max-score-picker"}]
    profile: list[dict[str, Any]] = [{"pluginRef": "prefix-cache-scorer", "weight": 2},
                                     {"pluginRef": "queue-scorer", "weight": 1},
                                     {"pluginRef": "kv-cache-utilization-scorer", "weight": 1}]
    if precise:
        plugins.insert(2, {"type": "precise-prefix-cache-scorer", "parameters": {
            "tokenProcessorConfig": {"blockSize": block_size, "hashSeed": KV_EVENTS_HASH_SEED},
            "kvEventsConfig": {"topicFilter": "kv@", "discoverPods": True,
                               "podDiscoveryConfig": {"socketPort": o.KV_EVENTS_PORT}}}})
        profile[0] = {"pluginRef": "precise-prefix-cache-scorer", "weight": 2}
    profile.append({"pluginRef": "max-score-picker"})
    return {"apiVersion": CONFIG_API, "kind": "EndpointPickerConfig", "plugins": plugins,
            "schedulingProfiles": [{"name": "default", "plugins": profile}]}


def picker_container(cluster: o.Cluster) -> dict[str, Any]:
    return {
        "name": "epp", "image": versions.LLMD_SCHEDULER_IMAGE, "imagePullPolicy": "IfNotPresent",
        "args": ["--pool-name", POOL, "--pool-namespace", cluster.namespace,
                 "--grpc-port", str(envoy.EPP_PORT), "--grpc-health-port", str(HEALTH_PORT),
                 "--metrics-port", str(gatewayapi.EPP_METRICS_PORT),
                 "--secure-serving=false",          # Envoy reaches it on localhost in plain h2c
                 "--config-file", "/config/plugins.yaml"],
        "ports": [{"name": "grpc", "containerPort": envoy.EPP_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": gatewayapi.EPP_METRICS_PORT, "protocol": "TCP"},
                  {"name": "kv-events", "containerPort": o.KV_EVENTS_PORT, "protocol": "TCP"}],
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "readinessProbe": {"grpc": {"port": HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 5},
        "livenessProbe": {"grpc": {"port": HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 10},
        "resources": o.resources("250m", "256Mi", "2", "1Gi"),
        "securityContext": o.container_security(),
        "volumeMounts": [{"name": "plugins", "mountPath": "/config", "readOnly": True}],
    }


def llm_d(topology: Topology, cluster: o.Cluster) -> list[Manifest]:
    ns = cluster.namespace
    labels = o.labels("llm-d")
    plugins = plugin_config(precise=cluster.gpu, block_size=topology.gpu.block_size)
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": o.meta(f"{NAME}-plugins", ns, labels),
              "data": {"plugins.yaml": yaml.safe_dump(plugins, sort_keys=False)}}
    # the picker reads its pool and (optional) objectives, and leases for leader election
    read = ["get", "list", "watch"]
    extra = [{"apiGroups": [gatewayapi.INFERENCE_GROUP], "resources": ["inferencepools"], "verbs": read},
             {"apiGroups": ["inference.networking.x-k8s.io"],
              "resources": ["inferenceobjectives", "inferencemodelrewrites"], "verbs": read},
             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": [*read, "create", "update"]}]
    pool = gatewayapi.inference_pool(POOL, ns, NAME, {o.PART_OF: "kvlab", o.COMPONENT: "replica"})
    return [o.namespace(cluster), *gatewayapi.rbac(NAME, ns, labels, extra), config, pool,
            *gatewayapi.data_plane(NAME, ns, labels, picker_container(cluster),
                                   [{"name": "plugins", "configMap": {"name": f"{NAME}-plugins"}}],
                                   o.NODE_PORTS["llm-d"], uid=LLMD_UID)]
