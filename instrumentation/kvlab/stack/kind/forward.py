"""Reaching the lab's Services from the host: the published NodePorts, or a port-forward.

kind/*.yaml publish the Services' NodePorts on 127.0.0.1, so the cache-blind baseline is reached
through kube-proxy exactly as in-cluster clients reach it. Where those ports are not mapped (a
cluster kvlab did not create), `PortForward` tunnels a local port to one ready pod of the Service
with the kubernetes client's portforward: right for the gateway, Jaeger, Prometheus and Grafana;
for the baseline it pins a single replica, which defeats the point, so it warns.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import urllib.request
from typing import Any

from kvlab.errors import StackError
from kvlab.stack.kind import objects as o
from kvlab.stack.kind.envoy import LISTEN_PORT
from kvlab.stack.kind.runner import api_client

# target name -> (Service name, Service port, UI path)
SERVICES = {
    "baseline": ("kvlab-baseline", o.API_PORT, "/v1"),
    "gateway": ("kvlab-gateway", o.API_PORT, "/v1"),
    "gateway-api": ("kvlab-epp", LISTEN_PORT, "/v1"),           # Envoy + kvlab epp (docs/gateway-api.md)
    "llm-d": ("kvlab-llm-d", LISTEN_PORT, "/v1"),               # Envoy + llm-d's scheduler
    "jaeger": ("kvlab-jaeger", 16686, "/"),
    "otlp": ("kvlab-jaeger", 4318, "/"),          # OTLP/HTTP into the in-cluster Jaeger (client spans)
    "prometheus": ("kvlab-prometheus", 9090, "/"),
    "grafana": ("kvlab-grafana", 3000, "/"),
}


def node_port_url(target: str) -> str:
    return f"http://127.0.0.1:{o.NODE_PORTS[target]}"


def _answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status: int = resp.status
            return 200 <= status < 500
    except Exception:
        return False


class PortForward:
    """A local TCP listener whose every connection is tunnelled to `port` of one pod."""

    def __init__(self, core: Any, namespace: str, pod: str, port: int, local_port: int = 0) -> None:
        self.core, self.namespace, self.pod, self.port = core, namespace, pod, port
        self._server = socket.create_server(("127.0.0.1", local_port))
        self.local_port = self._server.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name=f"kvlab-forward-{pod}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        from kubernetes.stream import portforward

        try:
            pf = portforward(self.core.connect_get_namespaced_pod_portforward, self.pod, self.namespace,
                             ports=str(self.port))
            remote = pf.socket(self.port)
        except Exception as exc:
            print(f"kvlab cluster forward: {self.pod}:{self.port}: {exc}", file=sys.stderr)
            conn.close()
            return

        def copy(src: Any, dst: Any) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=copy, args=(remote, conn), daemon=True)
        back.start()
        copy(conn, remote)
        back.join()
        conn.close()
        remote.close()
        pf.close()

    def close(self) -> None:
        self._closed.set()
        self._server.close()

    def __enter__(self) -> PortForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ready_pod(core: Any, namespace: str, service: str) -> str:
    """Name of a ready pod behind `service` (by the Service's selector)."""
    svc = core.read_namespaced_service(service, namespace)
    selector = ",".join(f"{k}={v}" for k, v in (svc.spec.selector or {}).items())
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        conditions = pod.status.conditions or []
        if pod.status.phase == "Running" and any(c.type == "Ready" and c.status == "True" for c in conditions):
            name: str = pod.metadata.name
            return name
    raise StackError(f"no ready pod behind service {service} in {namespace}: `kvlab cluster status`")


def open_forward(target: str, context: str | None = None, namespace: str = "kvlab", local_port: int = 0) -> PortForward:
    """Port-forward a local port to the Service behind `target` (see SERVICES)."""
    from kubernetes import client

    if target == "baseline":
        print("kvlab: warning: a port-forward reaches ONE replica; use the NodePort URL "
              f"{node_port_url('baseline')} to go through kube-proxy", file=sys.stderr)
    service, port, _ = SERVICES[target]
    core = client.CoreV1Api(api_client(context))
    return PortForward(core, namespace, ready_pod(core, namespace, service), port, local_port)


_forwards: dict[tuple[str, str | None, str], PortForward] = {}


def cluster_target(target: str = "gateway", context: str | None = "kind-kvlab", namespace: str = "kvlab",
                   via: str = "auto") -> str:
    """Base URL (no trailing /v1) of the gateway or the cache-blind baseline for `kvlab bench`/`kvlab lab`.

    via="nodeport": the kind-published NodePort on 127.0.0.1 (through kube-proxy);
    via="port-forward": a port-forward kept open for the life of the process;
    via="auto": the NodePort when it answers /health, else a port-forward.
    """
    if target not in ("gateway", "baseline", "gateway-api", "llm-d"):
        raise StackError(f"cluster target must be 'gateway' or 'baseline' (or a Gateway API phase: 'gateway-api', "
                         f"'llm-d'), not {target!r}")
    url = node_port_url(target)
    if via == "nodeport" or (via == "auto" and _answers(url + "/health")):
        return url
    key = (target, context, namespace)
    if key not in _forwards:
        _forwards[key] = open_forward(target, context, namespace)
    return _forwards[key].url
