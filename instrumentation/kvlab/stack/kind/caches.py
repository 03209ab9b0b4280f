"""Resetting the replicas' prefix caches in a cluster, so every `kvlab lab --cluster` phase starts cold.

Each ready replica pod (the gateway's discovery selector) gets `POST /reset_prefix_cache` on each
of its HTTP ports (one per simulated data-parallel rank) through the API server's pod proxy: no
port-forward, no Service in between, works wherever the kube context reaches the API server.
A refused reset is reported, not raised: vLLM without `VLLM_SERVER_DEV_MODE=1` answers 404, and
vLLM refuses while requests run. The phase then starts warm, and the caller says so.
"""

from __future__ import annotations

from typing import Any

from kvlab.errors import StackError
from kvlab.gateway.discovery.kubernetes import pod_ready
from kvlab.stack.kind import objects as o
from kvlab.stack.kind.runner import api_client


def core_api(context: str | None) -> Any:
    """CoreV1Api for a kube context (None: the current one)."""
    from kubernetes import client

    return client.CoreV1Api(api_client(context))


def http_ports(pod: Any) -> list[int]:
    """A replica pod's HTTP ports: one per (simulated) data-parallel rank."""
    ports = [p.container_port for c in (pod.spec.containers if pod.spec else ()) for p in c.ports or ()
             if (p.name or "").startswith("http")]
    return ports or [o.API_PORT]


def ready_replicas(core: Any, namespace: str) -> list[Any]:
    """The ready replica pods (the gateway's discovery selector), by name; a StackError when they
    cannot be listed or none is ready."""
    from kubernetes.client.exceptions import ApiException

    try:
        pods = core.list_namespaced_pod(namespace, label_selector=o.REPLICA_SELECTOR).items
    except ApiException as exc:
        raise StackError(f"cannot list replica pods in {namespace}: {exc.status} {exc.reason}") from None
    ready = sorted((p for p in pods if pod_ready(p)), key=lambda p: p.metadata.name)
    if not ready:
        raise StackError(f"no ready replica pod ({o.REPLICA_SELECTOR}) in {namespace}: `kvlab cluster status`")
    return ready


def reset_prefix_caches(context: str | None = "kind-kvlab", namespace: str = "kvlab",
                        core: Any = None) -> dict[str, str | None]:
    """POST /reset_prefix_cache on every ready replica pod; {"pod:port": None if reset, else why not}.

    Raises StackError only when the pods cannot be listed or none is ready."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    core = core or core_api(context)
    results: dict[str, str | None] = {}
    for pod in ready_replicas(core, namespace):
        for port in http_ports(pod):
            target = f"{pod.metadata.name}:{port}"
            try:
                core.connect_post_namespaced_pod_proxy_with_path(target, namespace, path="reset_prefix_cache",
                                                                 _request_timeout=30)
                results[target] = None
            except ApiException as exc:
                hint = " (vLLM needs VLLM_SERVER_DEV_MODE=1)" if exc.status == 404 else ""
                results[target] = f"HTTP {exc.status} {exc.reason or ''}".rstrip() + hint
            except (HTTPError, OSError) as exc:   # timeout, connection reset: no reset either
                results[target] = f"{type(exc).__name__}: {exc}"
    return results
