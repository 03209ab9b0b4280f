""""Routing": where the gateway sent requests and why, how long deciding took, and the hit-rate
decomposition (available / predicted / delivered) of shared/DESIGN.md."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from kvlab.dashboards.panels import Query, board, graph, or_zero, quantile, rate, row
from kvlab.telemetry import names as n

UID = "kvlab-routing"


def build() -> dashboard.Dashboard:
    requests = rate(n.KVLAB_REQUESTS, by="replica")
    available = rate(n.KVLAB_PREFIX_TOKENS, 'kind="available"', by="policy")
    predicted = rate(n.KVLAB_PREFIX_TOKENS, 'kind="predicted"', by="policy")
    delivered = rate(n.KVLAB_PREFIX_TOKENS, 'kind="delivered"', by="policy")
    prompt = rate(n.KVLAB_PREFIX_TOKENS, 'kind="prompt"', by="policy")
    return (
        board(UID, "kvlab · Routing",
              "The KV-aware gateway's decisions: requests per replica, decision reasons, routing "
              "latency and the available / predicted / delivered hit rate.")
        .with_row(row("Where requests go"))
        .with_panel(graph("Requests per second per replica", [Query(requests, "{{replica}}")],
                          unit="reqps", width=8, stacked=True))
        .with_panel(graph("Requests per replica and policy", [
            Query(rate(n.KVLAB_REQUESTS, by="policy, replica"), "{{policy}} → {{replica}}")],
            unit="reqps", width=8))
        .with_panel(graph("In flight per replica (gateway view)", [
            Query(f"max by (replica) ({n.KVLAB_INFLIGHT})", "{{replica}}")], width=8))
        .with_row(row("Why"))
        .with_panel(graph("Decisions by reason", [
            Query(rate(n.KVLAB_DECISIONS, by="policy, reason"), "{{policy}}: {{reason}}")],
            unit="reqps", width=8, stacked=True,
            description="prefix = the chosen replica held the best prefix; load-over-prefix = a longer "
                        "prefix existed elsewhere but its load outweighed it; load = nobody held one; "
                        "round-robin/random = cache-blind pickers (scores kept in shadow)."))
        .with_panel(graph("Routing decision time p50 / p99", [
            Query(quantile(0.5, n.KVLAB_ROUTING_SECONDS, "policy"), "{{policy}} p50"),
            Query(quantile(0.99, n.KVLAB_ROUTING_SECONDS, "policy"), "{{policy}} p99"),
        ], unit="s", width=8, description="Block hashing + index lookup + scoring."))
        .with_panel(graph("Tokenization time p50 / p99", [
            Query(quantile(0.5, n.KVLAB_TOKENIZE_SECONDS), "p50"),
            Query(quantile(0.99, n.KVLAB_TOKENIZE_SECONDS), "p99"),
        ], unit="s", width=8))
        .with_row(row("Hit-rate decomposition"))
        .with_panel(graph("Available / predicted / delivered hit rate", [
            Query(f"{available} / {prompt}", "{{policy}} available"),
            Query(f"{predicted} / {prompt}", "{{policy}} predicted"),
            Query(f"{delivered} / {prompt}", "{{policy}} delivered"),
        ], unit="percentunit", width=12, minimum=0, maximum=1,
            description="available: best cached prefix on any replica; predicted: on the chosen one; "
                        "delivered: what the engine reused (cached_tokens). Fractions of prompt tokens."))
        .with_panel(graph("Cache lost to routing / to the index", [
            Query(f"({available} - {predicted}) / {prompt}", "{{policy}} lost to routing"),
            Query(f"({predicted} - {delivered}) / {prompt}", "{{policy}} lost to stale index / eviction"),
        ], unit="percentunit", width=12,
            description="available − predicted: a router choice left cache on the table; predicted − "
                        "delivered: the index believed in blocks the engine no longer had."))
        .with_row(row("The gateway's view of the replicas"))
        .with_panel(graph("Index blocks per replica", [
            Query(f"max by (replica, index) ({n.KVLAB_INDEX_BLOCKS})", "{{replica}} {{index}}")], width=8))
        .with_panel(graph("KV-event batches ingested per second", [
            Query(rate(n.KVLAB_KV_EVENTS, by="replica"), "{{replica}}")], unit="short", width=8))
        .with_panel(graph("Endpoint health, retries, ejections", [
            Query(f"min by (replica) ({n.KVLAB_ENDPOINT_HEALTHY})", "{{replica}} healthy"),
            Query(or_zero(rate(n.KVLAB_RETRIES, by="replica"), requests), "{{replica}} retries/s"),
            Query(or_zero(rate(n.KVLAB_EJECTIONS, by="replica"), requests), "{{replica}} ejections/s"),
            Query(or_zero(rate(n.KVLAB_UPSTREAM_ERRORS, by="replica, kind"), requests),
                  "{{replica}} upstream errors/s {{kind}}"),
            Query(or_zero(rate(n.KVLAB_KV_EVENT_GAPS, by="replica, kind"), requests),
                  "{{replica}} KV-event gaps/s {{kind}}"),
        ], width=8))
        .with_panel(graph("Generations resumed on another replica", [
            Query(or_zero(rate(n.KVLAB_RESUMES, by="reason"), requests), "resumed/s {{reason}}"),
            Query(or_zero(rate(n.KVLAB_REQUESTS, 'status=~"5.."', by="replica"), requests),
                  "{{replica}} failed to the client/s"),
        ], unit="reqps", width=8,
            description="A replica failed mid-generation and another continued it from the text the client "
                        "already had (stream: connection broken; error_event; ended: no finish reason; body: "
                        "an unstreamed answer cut off). Failed requests are what reached the client as errors."))
    )
