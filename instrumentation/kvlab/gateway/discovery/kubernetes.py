"""Endpoints from the Kubernetes API: the replica pods that match a label selector.

The gateway runs in the cluster with a ServiceAccount that may only get/list/watch pods (and
EndpointSlices) of its namespace. The pod list is read once, then followed with a watch; the
blocking watch runs in a thread and hands each complete endpoint set to the asyncio loop. Only
pods that are Ready and have an IP count. A dropped watch (API server restart, `410 Gone`,
network) is re-listed after an exponential backoff, so the gateway never goes down with it.

A replica pod that serves several data-parallel ranks says so with the annotation
`kvlab.io/data-parallel-size: "N"`: rank r listens on api_port + r (and kv_events_port + r),
and becomes an endpoint of its own (`<pod>-dp<r>`, `dp_rank=r`, `replica=<pod>`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from kvlab.contract import Endpoint
from kvlab.gateway.discovery.base import Discovery, OnChange

log = logging.getLogger(__name__)

ROLE_LABEL = "kvlab.io/role"
DP_SIZE_ANNOTATION = "kvlab.io/data-parallel-size"


def pod_ready(pod: Any) -> bool:
    """Running, has an IP, not being deleted, and its Ready condition is True."""
    status = pod.status
    if status is None or not status.pod_ip or status.phase != "Running":
        return False
    if pod.metadata.deletion_timestamp is not None:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def pod_endpoints(pod: Any, api_port: int, kv_events_port: int | None) -> list[Endpoint]:
    """The endpoints one ready replica pod serves (one per data-parallel rank)."""
    name = pod.metadata.name
    ip = pod.status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip
    role = (pod.metadata.labels or {}).get(ROLE_LABEL, "both")
    try:
        dp = max(1, int((pod.metadata.annotations or {}).get(DP_SIZE_ANNOTATION, "1")))
    except ValueError:
        dp = 1

    def one(rank: int) -> Endpoint:
        kv = f"tcp://{host}:{kv_events_port + rank}" if kv_events_port is not None else None
        if dp == 1:
            return Endpoint(name=name, url=f"http://{host}:{api_port}", kv_events=kv, role=role)
        return Endpoint(name=f"{name}-dp{rank}", url=f"http://{host}:{api_port + rank}", kv_events=kv,
                        role=role, dp_rank=rank, replica=name)

    return [one(r) for r in range(dp)]


def endpoints_of(pods: dict[str, Any], api_port: int, kv_events_port: int | None) -> list[Endpoint]:
    """The endpoint set of a pod map, sorted by name so equal sets compare equal."""
    out = [ep for pod in pods.values() if pod_ready(pod) for ep in pod_endpoints(pod, api_port, kv_events_port)]
    return sorted(out, key=lambda e: e.name)


def _default_api() -> Any:
    """CoreV1Api from the in-cluster config, falling back to the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.CoreV1Api()


class KubernetesDiscovery(Discovery):
    """Ready pods matching `selector` in `namespace`, followed with list + watch."""

    def __init__(
        self,
        namespace: str,
        selector: str,
        api_port: int = 8000,
        kv_events_port: int | None = 5557,
        *,
        api: Any = None,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        watch_timeout_s: int = 300,
    ) -> None:
        self.namespace = namespace
        self.selector = selector
        self.api_port = api_port
        self.kv_events_port = kv_events_port
        self._api = api
        self._backoff = backoff_s
        self._watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._watch: Any = None

    async def run(self, on_change: OnChange) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[Endpoint]] = asyncio.Queue()

        def publish(endpoints: list[Endpoint]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, endpoints)

        self._stop.clear()
        thread = threading.Thread(target=self._follow, args=(publish,), name="kvlab-k8s-discovery", daemon=True)
        thread.start()
        last: list[Endpoint] | None = None
        try:
            while True:
                endpoints = await queue.get()
                while not queue.empty():  # only the newest set matters
                    endpoints = queue.get_nowait()
                if endpoints != last:
                    last = endpoints
                    await on_change(list(endpoints))
        finally:
            self.stop()

    def stop(self) -> None:
        """Ask the watch thread to end (it does at the next event or timeout)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _follow(self, publish: Any) -> None:
        """List, then watch; on any error wait (backoff) and start over. Runs in a thread."""
        from kubernetes import watch

        delay = self._backoff[0]
        while not self._stop.is_set():
            try:
                api = self._api if self._api is not None else _default_api()
                self._api = api
                listed = api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                pods = {p.metadata.name: p for p in listed.items}
                publish(endpoints_of(pods, self.api_port, self.kv_events_port))
                self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                for event in self._watch.stream(
                    api.list_namespaced_pod, self.namespace, label_selector=self.selector,
                    resource_version=listed.metadata.resource_version, timeout_seconds=self._watch_timeout_s,
                ):
                    kind, pod = event["type"], event["object"]
                    if kind in ("ADDED", "MODIFIED"):
                        pods[pod.metadata.name] = pod
                    elif kind == "DELETED":
                        pods.pop(pod.metadata.name, None)
                    else:
                        continue
                    publish(endpoints_of(pods, self.api_port, self.kv_events_port))
                    delay = self._backoff[0]
                    if self._stop.is_set():
                        break
                # the watch ended normally (server timeout): re-list after a short pause
                self._stop.wait(self._backoff[0])
            except Exception as exc:
                if self._stop.is_set():
                    break
                log.warning("kubernetes discovery: %s; retrying in %.1fs", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, self._backoff[1])
