"""The observability phase's manifests: Jaeger v2 (unless traces are off or go elsewhere),
Prometheus discovering replica and gateway pods (with the lab's alert and recording rules), and
Grafana provisioned from `dashboards/`."""

from __future__ import annotations

import json
from typing import Any

import yaml

from kvlab.dashboards import rules
from kvlab.errors import ConfigError
from kvlab.stack.kind import objects as o
from kvlab.stack.kind import versions
from kvlab.topology import Topology


def _jaeger(cluster: o.Cluster) -> list[o.Manifest]:
    ns, labels = cluster.namespace, o.labels("jaeger")
    container = {
        "name": "jaeger", "image": versions.JAEGER_IMAGE, "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "otlp-grpc", "containerPort": 4317, "protocol": "TCP"},
                  {"name": "otlp-http", "containerPort": 4318, "protocol": "TCP"},
                  {"name": "ui", "containerPort": 16686, "protocol": "TCP"}],
        "readinessProbe": o.http_probe("/", "ui", 5, 3),
        "resources": o.resources("100m", "256Mi", "1", "1Gi"),
        "securityContext": o.container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    spec = {"automountServiceAccountToken": False, "enableServiceLinks": False,
            "securityContext": o.pod_security(10001), "containers": [container], "volumes": [o.empty_dir("tmp")]}
    ports = [{"name": "otlp-grpc", "port": 4317, "targetPort": "otlp-grpc", "protocol": "TCP"},
             {"name": "otlp-http", "port": 4318, "targetPort": "otlp-http", "protocol": "TCP"},
             {"name": "ui", "port": 16686, "targetPort": "ui", "protocol": "TCP", "nodePort": o.NODE_PORTS["jaeger"]}]
    return [o.deployment("kvlab-jaeger", ns, labels, 1, spec),
            o.service("kvlab-jaeger", ns, labels, {o.PART_OF: "kvlab", o.COMPONENT: "jaeger"}, ports, node_port=True)]


def _scrape_job(job: str, component: str, ns: str, interval: str) -> dict[str, Any]:
    return {
        "job_name": job,
        "scrape_interval": interval,
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [ns]},
                                   "selectors": [{"role": "pod", "label": f"{o.COMPONENT}={component}"}]}],
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


def prometheus_config(cluster: o.Cluster, interval: str = "2s") -> dict[str, Any]:
    """Jobs `replicas` and `gateway`, the same job names as the local stack's Prometheus, and the
    lab's rules (kvlab.dashboards.rules, mounted from the same ConfigMap)."""
    ns = cluster.namespace
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": ["/etc/prometheus/kvlab.rules.yaml"],
            "scrape_configs": [_scrape_job("replicas", "replica", ns, interval),
                               _scrape_job("gateway", "gateway", ns, interval)]}


def _prometheus(cluster: o.Cluster) -> list[o.Manifest]:
    ns, labels = cluster.namespace, o.labels("prometheus")
    config: o.Manifest = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": o.meta("kvlab-prometheus", ns, labels),
              "data": {"prometheus.yml": yaml.safe_dump(prometheus_config(cluster), sort_keys=False),
                       "kvlab.rules.yaml": rules.render()}}
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": o.meta("kvlab-prometheus", ns, labels),
          "automountServiceAccountToken": True}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": o.meta("kvlab-prometheus", ns, labels),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": o.meta("kvlab-prometheus", ns, labels),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kvlab-prometheus"},
               "subjects": [{"kind": "ServiceAccount", "name": "kvlab-prometheus", "namespace": ns}]}
    container = {
        "name": "prometheus", "image": versions.PROMETHEUS_IMAGE, "imagePullPolicy": "IfNotPresent",
        "args": ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus",
                 "--storage.tsdb.retention.time=2d"],
        "ports": [{"name": "web", "containerPort": 9090, "protocol": "TCP"}],
        "readinessProbe": o.http_probe("/-/ready", "web", 5, 3),
        "livenessProbe": o.http_probe("/-/healthy", "web", 15, 4),
        "resources": o.resources("100m", "256Mi", "1", "2Gi"),
        "securityContext": o.container_security(),
        "volumeMounts": [{"name": "config", "mountPath": "/etc/prometheus", "readOnly": True},
                         {"name": "data", "mountPath": "/prometheus"}],
    }
    spec = {"serviceAccountName": "kvlab-prometheus", "automountServiceAccountToken": True,
            "enableServiceLinks": False, "securityContext": o.pod_security(65534), "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": "kvlab-prometheus"}}, o.empty_dir("data", "4Gi")]}
    deployment = o.deployment("kvlab-prometheus", ns, labels, 1, spec,
                             {"kvlab.io/config-sha": _digest(config["data"])})
    service = o.service("kvlab-prometheus", ns, labels, {o.PART_OF: "kvlab", o.COMPONENT: "prometheus"},
                       [{"name": "web", "port": 9090, "targetPort": "web", "protocol": "TCP",
                         "nodePort": o.NODE_PORTS["prometheus"]}], node_port=True)
    return [config, sa, role, binding, deployment, service]


def _digest(data: dict[str, str]) -> str:
    """A short content hash on the pod template, so a changed ConfigMap rolls the pods."""
    import hashlib

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def grafana_datasources(cluster: o.Cluster) -> dict[str, Any]:
    """Datasources for Grafana in the cluster: the observability part's provisioning file when it
    exists (so the uids its dashboards reference match), with URLs pointed at the in-cluster services."""
    ns = cluster.namespace
    urls = {"prometheus": f"http://kvlab-prometheus.{ns}.svc:9090", "jaeger": f"http://kvlab-jaeger.{ns}.svc:16686"}
    found: list[dict[str, Any]] = []
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


def grafana_dashboards(cluster: o.Cluster) -> dict[str, str]:
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


def _grafana(cluster: o.Cluster) -> list[o.Manifest]:
    ns, labels = cluster.namespace, o.labels("grafana")
    provider = {"apiVersion": 1, "providers": [{
        "name": "kvlab", "folder": "kvlab", "type": "file", "disableDeletion": True, "allowUiUpdates": False,
        "updateIntervalSeconds": 30, "options": {"path": "/etc/kvlab/dashboards", "foldersFromFilesStructure": False}}]}
    maps = {
        "kvlab-grafana-datasources": {"datasources.yaml": yaml.safe_dump(grafana_datasources(cluster),
                                                                         sort_keys=False)},
        "kvlab-grafana-providers": {"kvlab.yaml": yaml.safe_dump(provider, sort_keys=False)},
        "kvlab-grafana-dashboards": grafana_dashboards(cluster),
    }
    config_maps: list[o.Manifest] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": o.meta(name, ns, labels), "data": data}
        for name, data in maps.items()]
    env = [
        {"name": "GF_AUTH_ANONYMOUS_ENABLED", "value": "true"},
        {"name": "GF_AUTH_ANONYMOUS_ORG_ROLE", "value": "Viewer"},
        {"name": "GF_SECURITY_ADMIN_USER", "value": "admin"},
        o.secret_env("GF_SECURITY_ADMIN_PASSWORD", "kvlab-grafana", "admin-password"),
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
        "readinessProbe": o.http_probe("/api/health", "web", 5, 3),
        "resources": o.resources("100m", "256Mi", "1", "1Gi"),
        "securityContext": o.container_security(),
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
               o.empty_dir("data", "1Gi"), o.empty_dir("logs", "256Mi"), o.empty_dir("tmp")]
    spec = {"automountServiceAccountToken": False, "enableServiceLinks": False,
            "securityContext": o.pod_security(472), "containers": [container], "volumes": volumes}
    sha = _digest({k: v for m in config_maps for k, v in m["data"].items()})
    deployment = o.deployment("kvlab-grafana", ns, labels, 1, spec, {"kvlab.io/config-sha": sha})
    service = o.service("kvlab-grafana", ns, labels, {o.PART_OF: "kvlab", o.COMPONENT: "grafana"},
                       [{"name": "web", "port": 3000, "targetPort": "web", "protocol": "TCP",
                         "nodePort": o.NODE_PORTS["grafana"]}], node_port=True)
    return [*config_maps, deployment, service]


def observability(topology: Topology, cluster: o.Cluster) -> list[o.Manifest]:
    """Jaeger (unless traces are off or go elsewhere), Prometheus and Grafana (unless prometheus: off)."""
    out = [o.namespace(cluster)]
    if o.otlp_endpoint(topology, cluster.namespace) == f"http://kvlab-jaeger.{cluster.namespace}.svc:4318":
        out += _jaeger(cluster)
    if topology.observability.prometheus != "off":
        out += _prometheus(cluster) + _grafana(cluster)
    return out
