"""The gateway's Prometheus metrics (names from kvlab.telemetry.names), in their own registry.

Per-replica gauges (in flight, health, index size) are read from the live state at scrape time
by a collector, so the request path never updates them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from kvlab.telemetry import names

_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


# per replica: name, in flight, healthy, precise blocks, approximate blocks, KV-event feed state
Snapshot = Callable[[], Iterable[tuple[str, int, bool, int, int, str]]]
EVENT_STATES = ("none", "connecting", "live", "stale")   # endpoints.Backend.events_state


class _StateCollector:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(names.KVLAB_INFLIGHT, "requests in flight per replica", labels=["replica"])
        healthy = GaugeMetricFamily(names.KVLAB_ENDPOINT_HEALTHY, "1 when the replica is a candidate",
                                    labels=["replica"])
        blocks = GaugeMetricFamily(names.KVLAB_INDEX_BLOCKS, "blocks the gateway believes each replica holds",
                                   labels=["replica", "index"])
        events = GaugeMetricFamily(names.KVLAB_KV_EVENTS_STATE, "KV-event feed state per replica (1 = current)",
                                   labels=["replica", "state"])
        for name, n, ok, precise, approx, state in self.snapshot():
            inflight.add_metric([name], n)
            healthy.add_metric([name], 1.0 if ok else 0.0)
            blocks.add_metric([name, "precise"], precise)
            blocks.add_metric([name, "approximate"], approx)
            for s in EVENT_STATES:
                events.add_metric([name, s], 1.0 if s == state else 0.0)
        yield from (inflight, healthy, blocks, events)


class _DeprecatedAliases:
    """Each renamed metric again under its old name (names.KVLAB_DEPRECATED_ALIASES), same samples,
    so dashboards and alerts written for the old name keep working for one release."""

    def __init__(self, metrics: dict[str, object]) -> None:
        self.metrics = metrics   # current name -> the metric object that owns it

    def collect(self) -> Iterator[Metric]:
        for old, new in names.KVLAB_DEPRECATED_ALIASES.items():
            for family in self.metrics[new].collect():  # type: ignore[attr-defined]
                alias = Metric(old, f"DEPRECATED: renamed to {new}. {family.documentation}", family.type)
                alias.samples = [s._replace(name=old + s.name[len(new):]) for s in family.samples]
                yield alias


class GatewayMetrics:
    def __init__(self, snapshot: Snapshot) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(names.KVLAB_REQUESTS, "proxied requests", ["replica", "policy", "status"], registry=r)
        self.decisions = Counter(names.KVLAB_DECISIONS, "routing decisions by reason", ["policy", "reason"], registry=r)
        self.prefix_tokens = Counter(names.KVLAB_PREFIX_TOKENS,
                                     "prompt tokens: prompt, available, predicted, delivered",
                                     ["policy", "kind"], registry=r)
        self.routing = Histogram(names.KVLAB_ROUTING_SECONDS, "hashing + index lookup + scoring",
                                 ["policy"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tokenize = Histogram(names.KVLAB_TOKENIZE_SECONDS, "prompt tokenization at the gateway",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(names.KVLAB_GATEWAY_TTFT, "time to first streamed byte seen at the gateway",
                              ["policy", "replica"], buckets=_TTFT_BUCKETS, registry=r)
        self.upstream_errors = Counter(names.KVLAB_UPSTREAM_ERRORS, "upstream failures",
                                       ["replica", "kind"], registry=r)
        self.retries = Counter(names.KVLAB_RETRIES, "requests retried on another replica", ["replica"], registry=r)
        self.resumes = Counter(names.KVLAB_RESUMES, "broken generations resumed on another replica", ["reason"],
                               registry=r)
        self.ejections = Counter(names.KVLAB_EJECTIONS, "replicas ejected after failures", ["replica"], registry=r)
        self.kv_events = Counter(names.KVLAB_KV_EVENTS, "KV-event batches ingested", ["replica"], registry=r)
        self.kv_event_gaps = Counter(names.KVLAB_KV_EVENT_GAPS, "KV-event stream gaps and restarts",
                                     ["replica", "kind"], registry=r)
        self.pd_decisions = Counter(names.KVLAB_PD_DECISIONS, "P/D decisions: split, unified, fallback (to unified)",
                                    ["decision", "reason"], registry=r)
        self.kv_transfer = Histogram(names.KVLAB_KV_TRANSFER_SECONDS, "KV pulled by decode replicas (their report)",
                                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                                     registry=r)
        self.tokenizer_parity = Gauge(names.KVLAB_TOKENIZER_PARITY,
                                      "1 when the replica tokenizes the probe samples as the gateway does, 0 if not",
                                      ["replica"], registry=r)
        self.desired_replicas = Gauge(names.KVLAB_DESIRED_REPLICAS, "replicas the load needs (docs/autoscaling.md)",
                                      registry=r)
        self.current_replicas = Gauge(names.KVLAB_CURRENT_REPLICAS, "healthy replicas the recommendation counted",
                                      registry=r)
        r.register(_StateCollector(snapshot))
        r.register(_DeprecatedAliases({names.KVLAB_KV_TRANSFER_SECONDS: self.kv_transfer}))
