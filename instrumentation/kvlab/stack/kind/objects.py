"""The objects every kind manifest is built from: the cluster settings, the labels and ports the
parts agree on, and small builders (metadata, secure containers and pods, Deployments, Services,
probes, environment) that give every workload the same secure defaults (manifests.py says which).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec

from kvlab import __version__
from kvlab.errors import ConfigError
from kvlab.stack.kind import versions
from kvlab.stack.launch import otel_env
from kvlab.topology import Topology

Manifest = dict[str, Any]

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




def labels(component: str, **extra: str) -> dict[str, str]:
    return {PART_OF: "kvlab", COMPONENT: component, "app.kubernetes.io/name": f"kvlab-{component}", **extra}


def meta(name: str, ns: str | None, labels: dict[str, str],
         annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if ns:
        meta["namespace"] = ns
    if annotations:
        meta["annotations"] = annotations
    return meta


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security(uid: int) -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def resources(cpu: str, memory: str, cpu_limit: str, memory_limit: str, **extra_limits: str) -> dict[str, Any]:
    return {"requests": {"cpu": cpu, "memory": memory},
            "limits": {"cpu": cpu_limit, "memory": memory_limit, **extra_limits}}


def empty_dir(name: str, size: str = "256Mi", medium: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"sizeLimit": size}
    if medium:
        spec["medium"] = medium
    return {"name": name, "emptyDir": spec}


def http_probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 2}


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}


def deployment(name: str, ns: str, labels: dict[str, str], replicas: int, pod_spec: dict[str, Any],
                annotations: dict[str, str] | None = None) -> Manifest:
    selector = {k: v for k, v in labels.items() if k in (PART_OF, COMPONENT, POOL_LABEL)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": meta(name, ns, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {"metadata": meta_template(labels, annotations), "spec": pod_spec},
        },
    }


def meta_template(labels: dict[str, str], annotations: dict[str, str] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return meta


def service(name: str, ns: str, labels: dict[str, str], selector: dict[str, str], ports: list[dict[str, Any]],
             node_port: bool = False) -> Manifest:
    spec: dict[str, Any] = {"selector": selector, "ports": ports}
    spec["type"] = "NodePort" if node_port else "ClusterIP"
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, ns, labels), "spec": spec}


def scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def pod_otel_env(topology: Topology, service: str, ns: str) -> list[dict[str, Any]]:
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


def check_name(what: str, name: str) -> None:
    if not _DNS_LABEL.match(name) or len(name) > 40:
        raise ConfigError(f"kind: {what} {name!r} must be a DNS label (lowercase letters, digits, '-'; <= 40 chars)")


def namespace(cluster: Cluster) -> Manifest:
    """The lab namespace; Pod Security `restricted` is enforced, so a weaker pod is refused."""
    labels = {PART_OF: "kvlab", "pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": cluster.namespace, "labels": labels}}
