""""Before / after": the lab's two phases side by side, split by the gateway's policy label
(round-robin = cache-blind baseline, kv-aware = the KV-aware gateway)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from kvlab.dashboards.panels import Query, board, graph, or_zero, quantile, rate, row, single
from kvlab.telemetry import names as n

UID = "kvlab-before-after"
GATEWAY_SERVICE = "kvlab-gateway"


def build() -> dashboard.Dashboard:
    requests_by_policy = rate(n.KVLAB_REQUESTS, by="policy")
    errors_by_policy = rate(n.KVLAB_REQUESTS, 'status!~"2.."', by="policy")
    delivered = rate(n.KVLAB_PREFIX_TOKENS, 'kind="delivered"', by="policy")
    prompt = rate(n.KVLAB_PREFIX_TOKENS, 'kind="prompt"', by="policy")
    return (
        board(UID, "kvlab · Before / after",
              "Cache-blind (round-robin) vs KV-aware routing on the same replicas and workload: "
              "TTFT, throughput and errors by the gateway's policy label.")
        .with_row(row("Time to first token"))
        .with_panel(graph("TTFT p50 / p95 by policy (gateway)", [
            Query(quantile(0.5, n.KVLAB_GATEWAY_TTFT, "policy"), "{{policy}} p50", exemplar=True),
            Query(quantile(0.95, n.KVLAB_GATEWAY_TTFT, "policy"), "{{policy}} p95", exemplar=True),
        ], unit="s", width=12, trace_service=GATEWAY_SERVICE,
            description="Time to the first streamed byte as the gateway sees it. Exemplars and the "
                        "panel link open the traces behind the points."))
        .with_panel(graph("TTFT p50 / p95, engines", [
            Query(quantile(0.5, n.VLLM_TTFT), "p50"),
            Query(quantile(0.95, n.VLLM_TTFT), "p95"),
        ], unit="s", width=12, description="vllm:time_to_first_token_seconds over every replica."))
        .with_row(row("Throughput"))
        .with_panel(graph("Requests per second by policy", [Query(requests_by_policy, "{{policy}}")],
                          unit="reqps", width=8))
        .with_panel(graph("Tokens per second, engines", [
            Query(rate(n.VLLM_GENERATION_TOKENS), "generated"),
            Query(rate(n.VLLM_PROMPT_TOKENS), "prompt (prefill)"),
            Query(rate(n.VLLM_PREFIX_CACHE_HITS), "prompt served from cache"),
        ], unit="short", width=8, description="Output tokens/s is the throughput; cached prompt "
                                              "tokens are prefill work the engines did not redo."))
        .with_panel(graph("Delivered prefix-cache hit rate by policy", [
            Query(f"{delivered} / {prompt}", "{{policy}}"),
        ], unit="percentunit", width=8, minimum=0, maximum=1,
            description="cached_tokens reported by the replicas / prompt tokens, per policy."))
        .with_row(row("Errors"))
        .with_panel(graph("Error ratio by policy", [
            Query(f"({or_zero(errors_by_policy, requests_by_policy)}) / {requests_by_policy}", "{{policy}}"),
        ], unit="percentunit", width=12, minimum=0,
            description="Responses with a non-2xx status / all responses (0 when there were none)."))
        .with_panel(single("Requests by policy (dashboard range)", [
            Query(f"sum by (policy) (increase({n.KVLAB_REQUESTS}_total[$__range]))", "{{policy}}"),
        ], width=12))
    )
