"""The gateway's Prometheus metrics (names from kvlab.telemetry.names), in their own registry.

Per-replica gauges (in flight, health, index size) are read from the live state at scrape time
by a collector, so the request path never updates them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from kvlab.telemetry import names

_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _StateCollector:
    def __init__(self, snapshot: Callable[[], Iterable[tuple[str, int, bool, int, int]]]) -> None:
        self.snapshot = snapshot

    def collect(self):
        inflight = GaugeMetricFamily(names.KVLAB_INFLIGHT, "requests in flight per replica", labels=["replica"])
        healthy = GaugeMetricFamily(names.KVLAB_ENDPOINT_HEALTHY, "1 when the replica is a candidate",
                                    labels=["replica"])
        blocks = GaugeMetricFamily(names.KVLAB_INDEX_BLOCKS, "blocks the gateway believes each replica holds",
                                   labels=["replica", "index"])
        for name, n, ok, precise, approx in self.snapshot():
            inflight.add_metric([name], n)
            healthy.add_metric([name], 1.0 if ok else 0.0)
            blocks.add_metric([name, "precise"], precise)
            blocks.add_metric([name, "approximate"], approx)
        yield from (inflight, healthy, blocks)


class GatewayMetrics:
    def __init__(self, snapshot: Callable[[], Iterable[tuple[str, int, bool, int, int]]]) -> None:
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
        r.register(_StateCollector(snapshot))
