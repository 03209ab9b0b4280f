"""The fake cluster `kvlab lab --cluster` and the notebooks' kind targets are tested against.

`FakeCore` is a CoreV1Api with what the cluster path calls: it lists real V1Pod objects and
forwards each pod-proxy POST and GET to the simulator replica that stands in for that pod (a pod
without one answers 404, like vLLM without VLLM_SERVER_DEV_MODE). Every POST is appended to `posts`
and, when `log` is given, to a JSON-lines file, so a test can read what a notebook kernel did;
every GET to `gets`.

`install(spec_file)` wires it into a process that is not the test's (a notebook kernel): it
replaces `forward.cluster_target` (the Service URLs) and `caches.core_api` (the API server) the
way test_cluster_target.py's monkeypatch does.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from kubernetes.client import (
    V1Container,
    V1ContainerPort,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodSpec,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

from kvlab.errors import StackError


def pod(name: str, ready: bool = True) -> V1Pod:
    """A replica pod as the Deployment renders it: an `http` and a `kv-events` port."""
    ports = [V1ContainerPort(name="http", container_port=8000), V1ContainerPort(name="kv-events", container_port=5557)]
    return V1Pod(
        metadata=V1ObjectMeta(name=name, namespace="kvlab", labels={"app.kubernetes.io/component": "replica"}),
        spec=V1PodSpec(containers=[V1Container(name="sim", ports=ports)]),
        status=V1PodStatus(phase="Running" if ready else "Pending", pod_ip="10.244.0.9" if ready else None,
                           conditions=[V1PodCondition(type="Ready", status="True" if ready else "False")]))


class FakeCore:
    """list_namespaced_pod + the pod proxy; `urls` maps a pod to the simulator replica behind it."""

    def __init__(self, pods: list[V1Pod], urls: dict[str, str], log: Path | None = None) -> None:
        self.pods, self.urls, self.log = pods, urls, log
        self.listed: list[tuple[str, str]] = []
        self.posts: list[tuple[float, str, str, str]] = []
        self.gets: list[tuple[str, str]] = []

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **_: object) -> V1PodList:
        self.listed.append((namespace, label_selector))
        return V1PodList(items=self.pods)

    def connect_post_namespaced_pod_proxy_with_path(self, name: str, namespace: str, path: str, **_: object) -> str:
        post = (time.time(), name, namespace, path)
        self.posts.append(post)
        url = self.urls.get(name.split(":", maxsplit=1)[0])
        status = 404
        try:
            if url is None:
                raise ApiException(status=404, reason="Not Found")
            req = urllib.request.Request(f"{url}/{path}", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                status = resp.status
                return str(resp.read().decode())
        finally:
            if self.log is not None:
                with self.log.open("a") as fh:
                    fh.write(json.dumps({"t": post[0], "target": name, "namespace": namespace, "path": path,
                                         "status": status, "done": time.time()}) + "\n")


    def connect_get_namespaced_pod_proxy_with_path(self, name: str, namespace: str, path: str, **_: object) -> str:
        self.gets.append((name, path))
        url = self.urls.get(name.split(":", maxsplit=1)[0])
        if url is None:
            raise ApiException(status=404, reason="Not Found")
        with urllib.request.urlopen(f"{url}/{path}", timeout=10) as resp:
            return str(resp.read().decode())


def install(spec_file: str) -> FakeCore:
    """Point this process's cluster path at the fake cluster `spec_file` describes:
    {"services": {"baseline": url, "gateway": url}, "pods": {name: url | null}, "refusing": [name],
    "log": path}; a pod without a URL is Pending unless it is `refusing`."""
    from kvlab.stack.kind import caches, forward

    spec = json.loads(Path(spec_file).read_text())
    refusing = spec.get("refusing", [])     # ready pods that answer 404 (vLLM without VLLM_SERVER_DEV_MODE)
    core = FakeCore([pod(name, ready=url is not None or name in refusing) for name, url in spec["pods"].items()],
                    {k: v for k, v in spec["pods"].items() if v}, Path(spec["log"]))

    def cluster_target(target: str = "gateway", context: str | None = "kind-kvlab", namespace: str = "kvlab",
                       via: str = "auto") -> str:
        return str(spec["services"][target])

    def open_forward(target: str, context: str | None = None, namespace: str = "kvlab",
                     local_port: int = 0) -> forward.PortForward:
        raise StackError(f"the fake cluster has no {target} Service")   # no in-cluster Jaeger here

    forward.cluster_target = cluster_target   # type: ignore[assignment]
    forward.open_forward = open_forward       # type: ignore[assignment]
    caches.core_api = lambda context: core    # type: ignore[assignment]
    return core
