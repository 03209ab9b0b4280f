"""The Gateway API phases of the kind path: an endpoint picker behind Envoy, and the CRD objects.

- `gateway-api`: the standalone data plane, no gateway controller needed: one pod with Envoy
  (envoy.py) and `kvlab epp` (kvlab's scheduler as the Inference Extension's endpoint picker),
  published on its own NodePort;
- `inference-pool`: for clusters with a conformant gateway (Istio, kgateway, NGINX Gateway
  Fabric...): an `InferencePool` selecting the replica pods and naming `kvlab epp` as its picker,
  a `Gateway` of the cluster's gateway class and an `HTTPRoute` to the pool. Needs the Gateway API
  and Inference Extension CRDs (`CRD_INSTALL`, docs/gateway-api.md); not part of `kvlab lab`.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvlab.stack.kind import envoy, versions
from kvlab.stack.kind import objects as o
from kvlab.topology import Topology

Manifest = dict[str, Any]
INFERENCE_GROUP = "inference.networking.k8s.io"
GATEWAY_GROUP = "gateway.networking.k8s.io"
EPP_METRICS_PORT = 9090
# kubectl apply steps, in order, for the CRDs the `inference-pool` phase (and llm-d's picker) read
CRD_INSTALL = (
    f"https://github.com/kubernetes-sigs/gateway-api/releases/download/{versions.GATEWAY_API_VERSION}/standard-install.yaml",
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/"
    f"{versions.INFERENCE_EXTENSION_VERSION}/manifests.yaml",
)


def rbac(name: str, ns: str, labels: dict[str, str], extra_rules: list[dict[str, Any]] | None = None) -> list[Manifest]:
    """A picker's least privilege: read the pods (and EndpointSlices) of its own namespace."""
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
             *(extra_rules or [])]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": o.meta(name, ns, labels),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": o.meta(name, ns, labels),
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": o.meta(name, ns, labels),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]},
    ]


def envoy_container(config_map: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Envoy container and its config volume."""
    container = {
        "name": "envoy", "image": versions.ENVOY_IMAGE, "imagePullPolicy": "IfNotPresent",
        "command": ["envoy"], "args": ["-c", "/etc/envoy/envoy.yaml", "--log-level", "info"],
        "ports": [{"name": "http", "containerPort": envoy.LISTEN_PORT, "protocol": "TCP"},
                  {"name": "envoy-ready", "containerPort": envoy.READY_PORT, "protocol": "TCP"}],
        "readinessProbe": o.http_probe("/ready", "envoy-ready", 5, 3),
        "resources": o.resources("100m", "128Mi", "1", "512Mi"),
        "securityContext": o.container_security(),
        "volumeMounts": [{"name": "envoy-config", "mountPath": "/etc/envoy", "readOnly": True}],
    }
    return container, {"name": "envoy-config", "configMap": {"name": config_map}}


def envoy_config_map(name: str, ns: str, labels: dict[str, str]) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": o.meta(name, ns, labels),
            "data": {"envoy.yaml": yaml.safe_dump(envoy.bootstrap(), sort_keys=False)}}


def epp_container(topology: Topology, cluster: o.Cluster) -> dict[str, Any]:
    """`kvlab epp` with the gateway's discovery, policy and telemetry (manifests.gateway's flags)."""
    g = topology.gateway
    args = ["epp", "--host", "0.0.0.0", "--port", str(envoy.EPP_PORT), "--metrics-port", str(EPP_METRICS_PORT),
            "--policy", g.policy, "--model", topology.model, "--scrape-interval-ms", str(g.scrape_interval_ms),
            "--discovery", "kubernetes", "--namespace", "$(POD_NAMESPACE)", "--selector", o.REPLICA_SELECTOR,
            "--replica-port", str(o.API_PORT), "--replica-kv-events-port", str(o.KV_EVENTS_PORT)]
    return {
        "name": "epp", "image": cluster.image, "imagePullPolicy": "IfNotPresent",
        "command": ["kvlab"], "args": args,
        "ports": [{"name": "grpc", "containerPort": envoy.EPP_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        "env": [o.field_env("POD_NAME", "metadata.name"), o.field_env("POD_NAMESPACE", "metadata.namespace"),
                {"name": "HOME", "value": "/tmp"}, *o.pod_otel_env(topology, "kvlab-epp", cluster.namespace)],
        "readinessProbe": {"grpc": {"port": envoy.EPP_PORT, "service": "readiness"}, "periodSeconds": 2,
                           "failureThreshold": 3},
        "livenessProbe": {"grpc": {"port": envoy.EPP_PORT, "service": "liveness"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "resources": o.resources("250m", "256Mi", "2", "1Gi"),
        "securityContext": o.container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def data_plane(name: str, ns: str, labels: dict[str, str], picker: dict[str, Any], volumes: list[dict[str, Any]],
               node_port: int | None, uid: int = o.KVLAB_UID) -> list[Manifest]:
    """Envoy + a picker in one pod (the standalone chart's layout), its config and its Service."""
    container, config_volume = envoy_container(f"{name}-envoy")
    spec: dict[str, Any] = {
        "serviceAccountName": name, "automountServiceAccountToken": True, "enableServiceLinks": False,
        "securityContext": o.pod_security(uid), "containers": [container, picker],
        "volumes": [config_volume, *volumes],
    }
    deployment = o.deployment(name, ns, labels, 1, spec, o.scrape_annotations(EPP_METRICS_PORT))
    port: dict[str, Any] = {"name": "http", "port": o.API_PORT, "targetPort": "http", "protocol": "TCP"}
    if node_port is not None:
        port["nodePort"] = node_port
    selector = {o.PART_OF: "kvlab", o.COMPONENT: labels[o.COMPONENT]}
    # the picker's port too: the InferencePool's endpointPickerRef names this Service
    grpc = {"name": "grpc", "port": envoy.EPP_PORT, "targetPort": "grpc", "protocol": "TCP",
            "appProtocol": "kubernetes.io/h2c"}
    service = o.service(name, ns, labels, selector, [port, grpc], node_port=node_port is not None)
    return [envoy_config_map(f"{name}-envoy", ns, labels), deployment, service]


def standalone(topology: Topology, cluster: o.Cluster) -> list[Manifest]:
    """Phase `gateway-api`: Envoy -> `kvlab epp` -> replica, no gateway controller."""
    ns, name = cluster.namespace, "kvlab-epp"
    labels = o.labels("epp")
    return [o.namespace(cluster), *rbac(name, ns, labels),
            *data_plane(name, ns, labels, epp_container(topology, cluster), [o.empty_dir("tmp")],
                        o.NODE_PORTS["gateway-api"])]


def inference_pool(name: str, ns: str, epp_service: str, selector: dict[str, str]) -> Manifest:
    """An `InferencePool` (inference.networking.k8s.io/v1): the replica pods and their picker."""
    return {"apiVersion": f"{INFERENCE_GROUP}/v1", "kind": "InferencePool",
            "metadata": o.meta(name, ns, o.labels("inference-pool")),
            "spec": {"selector": {"matchLabels": selector},
                     "targetPorts": [{"number": o.API_PORT}],
                     "endpointPickerRef": {"name": epp_service, "kind": "Service",
                                           "port": {"number": envoy.EPP_PORT}, "failureMode": "FailClose"}}}


def conformant(topology: Topology, cluster: o.Cluster, gateway_class: str = "istio") -> list[Manifest]:
    """Phase `inference-pool`: the picker as a Service for the cluster's own gateway, the pool, a
    Gateway of `gateway_class` and an HTTPRoute sending /v1 to the pool."""
    ns, name = cluster.namespace, "kvlab-epp"
    labels = o.labels("epp")
    spec: dict[str, Any] = {
        "serviceAccountName": name, "automountServiceAccountToken": True, "enableServiceLinks": False,
        "securityContext": o.pod_security(o.KVLAB_UID), "containers": [epp_container(topology, cluster)],
        "volumes": [o.empty_dir("tmp")]}
    service = o.service(name, ns, labels, {o.PART_OF: "kvlab", o.COMPONENT: "epp"},
                         [{"name": "grpc", "port": envoy.EPP_PORT, "targetPort": "grpc", "protocol": "TCP",
                           "appProtocol": "kubernetes.io/h2c"}])
    pool = inference_pool("kvlab-pool", ns, name, {o.PART_OF: "kvlab", o.COMPONENT: "replica"})
    gateway = {"apiVersion": f"{GATEWAY_GROUP}/v1", "kind": "Gateway",
               "metadata": o.meta("kvlab-inference-gateway", ns, o.labels("inference-gateway")),
               "spec": {"gatewayClassName": gateway_class,
                        "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}]}}
    route = {"apiVersion": f"{GATEWAY_GROUP}/v1", "kind": "HTTPRoute",
             "metadata": o.meta("kvlab-inference-route", ns, o.labels("inference-gateway")),
             "spec": {"parentRefs": [{"group": GATEWAY_GROUP, "kind": "Gateway", "name": "kvlab-inference-gateway"}],
                      "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                                 "backendRefs": [{"group": INFERENCE_GROUP, "kind": "InferencePool",
                                                  "name": "kvlab-pool"}],
                                 "timeouts": {"request": "300s"}}]}}
    return [o.namespace(cluster), *rbac(name, ns, labels),
            o.deployment(name, ns, labels, 1, spec, o.scrape_annotations(EPP_METRICS_PORT)), service,
            pool, gateway, route]
