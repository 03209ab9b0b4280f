"""The replica pods' Prometheus pages, read through the API server's pod proxy.

`kvlab compare --cluster` counts the requests each replica pod served from its own
`vllm:request_success_total` before and after a router's run, the way a local compare reads its
replicas' /metrics: no port-forward, no Service in between (caches.py resets them the same way).
"""

from __future__ import annotations

from typing import Any

from kvlab.stack.kind import caches


def replica_metrics(context: str | None = "kind-kvlab", namespace: str = "kvlab",
                    core: Any = None) -> dict[str, list[str]]:
    """{pod: its /metrics page per HTTP port} of every ready replica pod; a pod with a port that does
    not answer is left out (its count would be short)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    core = core or caches.core_api(context)
    out: dict[str, list[str]] = {}
    for pod in caches.ready_replicas(core, namespace):
        name = pod.metadata.name
        try:
            out[name] = [str(core.connect_get_namespaced_pod_proxy_with_path(f"{name}:{port}", namespace,
                                                                             path="metrics", _request_timeout=10))
                         for port in caches.http_ports(pod)]
        except (ApiException, HTTPError, OSError):
            continue
    return out
