""""P/D and data parallel": rows ready for prefill/decode disaggregation (issue 8) and wide
expert parallelism / data-parallel autoscaling (issue 9).

PENDING lists the metrics no component exports yet; the dashboard proof test exempts exactly the
queries of this dashboard that read one of them from its "every query returns series" rule.
Remove an entry when the metric lands (the test reports pending queries that already return data).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from kvlab.dashboards.panels import Query, board, graph, quantile, rate, row
from kvlab.telemetry import names as n

UID = "kvlab-pd-dp"

PENDING: dict[str, str] = {}   # the P/D metrics are proven on a run of the `pd` topology (issue 8)


def build() -> dashboard.Dashboard:
    return (
        board(UID, "kvlab · P/D and data parallel",
              "Prefill/decode split decisions, KV-transfer time, data-parallel rank load and the "
              "autoscaling signal.")
        .with_row(row("Prefill / decode disaggregation"))
        .with_panel(graph("P/D decisions by reason", [
            Query(rate(n.KVLAB_PD_DECISIONS, by="decision, reason"), "{{decision}}: {{reason}}")],
            unit="reqps", width=12, stacked=True, description="split vs unified, and why."))
        .with_panel(graph("KV transfer time p50 / p95", [
            Query(quantile(0.5, n.KVLAB_KV_TRANSFER_SECONDS), "p50"),
            Query(quantile(0.95, n.KVLAB_KV_TRANSFER_SECONDS), "p95"),
        ], unit="s", width=12))
        .with_row(row("Data parallel / wide expert parallelism"))
        .with_panel(graph("Running per data-parallel rank", [
            Query(f"sum by (instance, engine) ({n.VLLM_NUM_REQUESTS_RUNNING})", "{{instance}} rank {{engine}}")],
            width=8, description="vLLM's `engine` label is the data-parallel rank."))
        .with_panel(graph("Waiting per data-parallel rank", [
            Query(f"sum by (instance, engine) ({n.VLLM_NUM_REQUESTS_WAITING})", "{{instance}} rank {{engine}}")],
            width=8))
        .with_panel(graph("Desired replicas", [
            Query(f"max({n.KVLAB_DESIRED_REPLICAS})", "desired"),
            Query('count(up{job="replicas"} == 1)', "running"),
        ], width=8))
    )
