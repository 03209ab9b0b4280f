""""Replicas": what each model server reports under vLLM's own metric names (the simulator and
real vLLM alike), per scrape target."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from kvlab.dashboards.panels import Query, board, graph, quantile, rate, row
from kvlab.telemetry import names as n

UID = "kvlab-replicas"


def build() -> dashboard.Dashboard:
    hits = rate(n.VLLM_PREFIX_CACHE_HITS, by="instance")
    queries = rate(n.VLLM_PREFIX_CACHE_QUERIES, by="instance")
    return (
        board(UID, "kvlab · Replicas",
              "Queue, running batch, KV-cache usage and prefix-cache hit rate of every replica "
              "(vllm:* metrics), per scrape target.")
        .with_row(row("Load"))
        .with_panel(graph("Waiting (queue)", [
            Query(f"sum by (instance) ({n.VLLM_NUM_REQUESTS_WAITING})", "{{instance}}")], width=8))
        .with_panel(graph("Running (batch)", [
            Query(f"sum by (instance) ({n.VLLM_NUM_REQUESTS_RUNNING})", "{{instance}}")], width=8))
        .with_panel(graph("KV-cache usage", [
            Query(f"avg by (instance) ({n.VLLM_KV_CACHE_USAGE})", "{{instance}}")],
            unit="percentunit", width=8, minimum=0, maximum=1,
            description="Mean over a replica's engines (data-parallel ranks): each reports its own cache's fraction."))
        .with_row(row("Prefix cache"))
        .with_panel(graph("Engine prefix-cache hit rate", [Query(f"{hits} / {queries}", "{{instance}}")],
                          unit="percentunit", width=12, minimum=0, maximum=1,
                          description="prefix_cache_hits / prefix_cache_queries (tokens) per replica."))
        .with_panel(graph("Prompt tokens per second: computed vs cached", [
            Query(rate(n.VLLM_PROMPT_TOKENS, by="instance"), "{{instance}} prompt"),
            Query(hits, "{{instance}} from cache"),
        ], width=12))
        .with_panel(graph("Prefix-cache hit rate by tier (GPU, CPU offload)", [
            Query(f"{hits} / {queries}", "{{instance}} GPU"),
            Query(f"{rate(n.VLLM_EXTERNAL_PREFIX_CACHE_HITS, by='instance')} / {queries}", "{{instance}} CPU"),
        ], unit="percentunit", width=24, minimum=0, maximum=1,
            description="Share of queried prompt tokens found on GPU (prefix_cache_hits) and loaded from the "
                        "CPU offload tier instead of recomputed (external_prefix_cache_hits, vLLM's KV-connector "
                        "counter). No CPU series without an offload tier (docs/tiered.md)."))
        .with_row(row("Latency and work"))
        .with_panel(graph("TTFT p50 / p95 per replica", [
            Query(quantile(0.5, n.VLLM_TTFT, "instance"), "{{instance}} p50"),
            Query(quantile(0.95, n.VLLM_TTFT, "instance"), "{{instance}} p95"),
        ], unit="s", width=8, trace_service="kvlab-sim"))
        .with_panel(graph("Queue time p95 / inter-token latency p50", [
            Query(quantile(0.95, n.VLLM_QUEUE_TIME, "instance"), "{{instance}} queue p95"),
            Query(quantile(0.5, n.VLLM_ITL, "instance"), "{{instance}} ITL p50"),
        ], unit="s", width=8))
        .with_panel(graph("Generated tokens per second, preemptions", [
            Query(rate(n.VLLM_GENERATION_TOKENS, by="instance"), "{{instance}} tokens/s"),
            Query(rate(n.VLLM_NUM_PREEMPTIONS, by="instance"), "{{instance}} preemptions/s"),
        ], width=8))
    )
