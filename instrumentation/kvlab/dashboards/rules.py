"""Prometheus recording and alerting rules for the lab, rendered to dashboards/rules/kvlab.rules.yaml
(beside the dashboards, from the same metric names) and loaded by the local and the kind Prometheus.

Modelled on the KV-cache alerts llm-d ships for its indexer (hit rate low, index lookup slow,
events stalled / reconnecting, tokenization slow), on kvlab's own metrics. `for:` durations and
thresholds are sized for a lab: a run lasts minutes and Prometheus scrapes every second or two.
Recording rules follow Prometheus's `level:metric:operations` naming; the hit ratios are the
available / predicted / delivered decomposition of docs/observability.md.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvlab.telemetry import names as n

FILE = "rules/kvlab.rules.yaml"       # under dashboards/; the Prometheus configs name it
WINDOW = "1m"

_TOKENS = "kvlab:prefix_tokens:rate1m"


def _tokens(kind: str) -> str:
    return f'sum by (policy) ({_TOKENS}{{kind="{kind}"}})'


RECORDS: dict[str, str] = {
    _TOKENS: f"sum by (policy, kind) (rate({n.KVLAB_PREFIX_TOKENS}_total[{WINDOW}]))",
    "kvlab:available_hit_ratio:rate1m": f'{_tokens("available")} / {_tokens("prompt")}',
    "kvlab:predicted_hit_ratio:rate1m": f'{_tokens("predicted")} / {_tokens("prompt")}',
    "kvlab:delivered_hit_ratio:rate1m": f'{_tokens("delivered")} / {_tokens("prompt")}',
    # predicted − delivered: cache the index promised that the engine did not reuse
    "kvlab:index_overpromise_ratio:rate1m": f'({_tokens("predicted")} - {_tokens("delivered")}) / {_tokens("prompt")}',
    "kvlab:tokenize_seconds:p95_rate1m":
        f"histogram_quantile(0.95, sum by (le) (rate({n.KVLAB_TOKENIZE_SECONDS}_bucket[{WINDOW}])))",
    "kvlab:routing_seconds:p95_rate1m":
        f"histogram_quantile(0.95, sum by (le, policy) (rate({n.KVLAB_ROUTING_SECONDS}_bucket[{WINDOW}])))",
}


def _alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description}}


ALERTS: list[dict[str, Any]] = [
    _alert("KvlabPrefixHitRateLow",
           "kvlab:delivered_hit_ratio:rate1m < 0.5 * kvlab:available_hit_ratio:rate1m"
           " and kvlab:available_hit_ratio:rate1m > 0.2",
           "1m", "warning", "Policy {{ $labels.policy }} reuses under half the cached prefix that exists",
           "Delivered hit ratio {{ $value | humanizePercentage }}, while more than 20 % of prompt tokens "
           "were cached on some replica: routing leaves cache on the table (a cache-blind baseline "
           "does this by design)."),
    _alert("KvlabIndexOverpromises",
           "kvlab:index_overpromise_ratio:rate1m > 0.1",
           "1m", "warning", "Index predicts cache hits the engines do not deliver ({{ $labels.policy }})",
           "Predicted minus delivered is {{ $value | humanizePercentage }} of prompt tokens: the index is "
           "stale (lost KV events, eviction it did not see) or hashes blocks differently from the engine."),
    _alert("KvlabKVEventsStalled",
           f"(sum by (replica) (rate({n.KVLAB_REQUESTS}_total[{WINDOW}])) > 0)"
           f' and on (replica) (max by (replica) ({n.KVLAB_KV_EVENTS_STATE}{{state=~"connecting|live"}}) == 1)'
           f" unless on (replica) (sum by (replica) (rate({n.KVLAB_KV_EVENTS}_total[{WINDOW}])) > 0)",
           "30s", "warning", "No KV events from {{ $labels.replica }} while it serves requests",
           "The replica gets traffic but its KV-event stream delivered nothing for a minute: the precise "
           "index no longer follows its cache."),
    _alert("KvlabKVEventGaps",
           f"sum by (replica, kind) (increase({n.KVLAB_KV_EVENT_GAPS}_total[5m])) > 0",
           "0s", "warning", "KV-event stream of {{ $labels.replica }}: {{ $labels.kind }}",
           "Batches were lost (gap) or the engine restarted (restart); the index dropped that replica's "
           "entries and is resyncing."),
    _alert("KvlabIndexStale",
           f'max by (replica) ({n.KVLAB_KV_EVENTS_STATE}{{state="stale"}}) == 1',
           "30s", "warning", "Precise index of {{ $labels.replica }} is stale",
           "After a KV-event gap the replica is routed on the approximate index until the stream has been "
           "gap-free for the resync time; it has not recovered."),
    _alert("KvlabTokenizationSlow",
           "kvlab:tokenize_seconds:p95_rate1m > 0.01",
           "1m", "warning", "Gateway tokenization p95 above 10 ms",
           "Tokenization p95 is {{ $value | humanizeDuration }}; it adds to every request's TTFT."),
    _alert("KvlabIndexLookupSlow",
           "kvlab:routing_seconds:p95_rate1m > 0.005",
           "1m", "warning", "Routing (hashing + index lookup + scoring) p95 above 5 ms ({{ $labels.policy }})",
           "Routing p95 is {{ $value | humanizeDuration }}."),
    _alert("KvlabReplicaEjected",
           f"max by (replica) ({n.KVLAB_ENDPOINT_HEALTHY}) == 0",
           "5s", "critical", "Replica {{ $labels.replica }} is ejected",
           "The gateway stopped routing to it after consecutive failures (scrapes or requests)."),
    _alert("KvlabDesiredReplicasAboveCurrent",
           f"max({n.KVLAB_DESIRED_REPLICAS}) > max({n.KVLAB_CURRENT_REPLICAS})",
           "1m", "warning", "The load needs {{ $value }} replicas; fewer are serving",
           "The gateway's autoscaling recommendation has stayed above the healthy replica count "
           "(docs/autoscaling.md): nothing is acting on it, or scale-up is slow."),
]


def rules() -> dict[str, Any]:
    """The rule file (Prometheus rule-file format) as a document."""
    return {"groups": [
        {"name": "kvlab-recording", "rules": [{"record": k, "expr": v} for k, v in RECORDS.items()]},
        {"name": "kvlab-alerts", "rules": ALERTS},
    ]}


HEADER = ("# Generated by `kvlab dashboards` from instrumentation/kvlab/dashboards/rules.py - do not edit.\n"
          "# Prometheus recording and alerting rules for the kvlab lab (docs/observability.md#alerts).\n")


def render() -> str:
    body: str = yaml.safe_dump(rules(), sort_keys=False, width=120)
    return HEADER + body
