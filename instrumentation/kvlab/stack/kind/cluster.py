"""`ClusterStack`: a kind cluster deployed by `kvlab cluster deploy`, as the run pipeline sees it.

It starts nothing: the replicas, the gateway and the cache-blind baseline Service already run.
`gateway_for("kube-proxy")` is the baseline Service, any other policy the kvlab gateway (which
routes with the policy it was deployed with); caches are reset through the API server's pod
proxy on every ready replica pod (`caches.reset_prefix_caches`); the client's spans go to the
in-cluster Jaeger through a port-forward when one can be opened. `kvlab lab --cluster`,
`kvlab compare --cluster` (which also reads each replica pod's request counter through the pod
proxy) and the notebooks' kind targets use it (issue 18 item 4).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvlab.stack.base import StackInfo
from kvlab.stack.kind import caches, forward, metrics

BASELINE = "kube-proxy"   # the baseline phase's "policy": kube-proxy's per-connection spreading
KIND_URLS = {"jaeger": "http://127.0.0.1:30686", "prometheus": "http://127.0.0.1:30090",
             "grafana": "http://127.0.0.1:30300"}   # NodePorts kind/*.yaml publishes (docs/kind.md)


class ClusterStack:
    """The lab's Services in `namespace` of kube `context`."""

    def __init__(self, run_dir: Path, context: str | None = "kind-kvlab", namespace: str = "kvlab",
                 target: str = "cluster", topology: str | None = None, policy: str | None = None,
                 warn: Callable[[str], None] | None = None, export_spans: bool = True) -> None:
        self.run_dir, self.context, self.namespace = Path(run_dir), context, namespace
        self.target, self.topology, self.policy = target, topology, policy
        self.warn = warn or (lambda _message: None)
        self.export_spans = export_spans
        self.resets: list[dict[str, str | None]] = []    # one per reset_caches(), in order
        self._otlp: forward.PortForward | None = None
        self._urls: dict[str, str] = {}

    @property
    def otlp_endpoint(self) -> str | None:
        return self._otlp.url if self._otlp is not None else None

    def start(self) -> None:
        """Open the port-forward to the in-cluster Jaeger's OTLP port (best effort: without the
        observability phase deployed, or without access, client spans stay local)."""
        if self.export_spans and self._otlp is None:
            try:
                self._otlp = forward.open_forward("otlp", self.context, self.namespace)
            except Exception:   # no kubeconfig, no Jaeger Service, no ready pod: no client spans
                self._otlp = None

    def url(self, which: str) -> str:
        """Base URL of the `gateway` or the `baseline` Service (resolved once)."""
        if which not in self._urls:
            self._urls[which] = forward.cluster_target(which, context=self.context, namespace=self.namespace)
        return self._urls[which]

    def gateway_for(self, policy: str, fresh: bool = True, entry: str | None = None) -> str:
        """`entry` (baseline, gateway, gateway-api, llm-d) when given; else the baseline Service for
        `kube-proxy` and the deployed gateway for any other policy (it cannot be restarted per phase:
        its routing state carries over, its caches are reset with the replicas')."""
        return self.url(entry or ("baseline" if policy == BASELINE else "gateway"))

    def reset_caches(self) -> dict[str, str | None]:
        """POST /reset_prefix_cache on every ready replica pod; a refused reset is a warning."""
        result = caches.reset_prefix_caches(self.context, self.namespace)
        for target, why in result.items():
            if why:
                self.warn(f"warning: {target}: reset_prefix_cache refused: {why}; "
                          "this phase starts with a warm cache")
        self.resets.append(result)
        return result

    def replica_names(self) -> list[str]:
        """The ready replica pods (the ones `reset_caches` resets)."""
        return [p.metadata.name for p in caches.ready_replicas(caches.core_api(self.context), self.namespace)]

    def replica_metrics(self) -> dict[str, list[str]]:
        """Each ready replica pod's /metrics, one page per HTTP port, through the pod proxy."""
        return metrics.replica_metrics(self.context, self.namespace)

    def peer_counters(self) -> dict[str, float]:
        """Nothing: kube-proxy keeps no routing counters and llm-d's scheduler's metrics are not read."""
        return {}

    def served_model(self) -> str:
        """The model name the gateway serves (whatever the target)."""
        with urllib.request.urlopen(f"{self.url('gateway')}/v1/models", timeout=10) as resp:
            return str(json.load(resp)["data"][0]["id"])

    def describe(self) -> StackInfo:
        return StackInfo(id=self.run_dir.name, run_dir=str(self.run_dir), target=self.target,
                         deployed=self.topology, policy=self.policy,
                         gateway=self._urls.get("gateway"), baseline=self._urls.get("baseline"),
                         otlp_endpoint=self.otlp_endpoint, context=self.context, namespace=self.namespace,
                         jaeger=KIND_URLS["jaeger"], prometheus=KIND_URLS["prometheus"], grafana=KIND_URLS["grafana"])

    def stop(self) -> None:
        """Close the port-forward; the cluster keeps running."""
        if self._otlp is not None:
            self._otlp.close()
            self._otlp = None

    def __enter__(self) -> ClusterStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
