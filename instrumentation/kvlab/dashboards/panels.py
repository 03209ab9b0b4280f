"""Small helpers over grafana-foundation-sdk: typed panels whose queries name metrics only through
kvlab.telemetry.names, and the PromQL idioms the dashboards share."""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    StackingMode,
    TooltipDisplayMode,
    VisibilityMode,
)
from grafana_foundation_sdk.models.dashboard import DashboardLinkType, DataSourceRef

PROMETHEUS_UID = "prometheus"      # the provisioned datasources' uids (dashboards/provisioning/)
JAEGER_UID = "jaeger"
PROMETHEUS = DataSourceRef(type_val="prometheus", uid=PROMETHEUS_UID)
RATE = "$__rate_interval"          # Grafana's rate window: ≥ 4 scrape intervals


def _select(series: str, selector: str) -> str:
    return f"{series}{{{selector}}}" if selector else series


def counter(name: str) -> str:
    """A counter's exposed series name (Prometheus adds `_total`)."""
    return f"{name}_total"


def rate(name: str, selector: str = "", by: str = "") -> str:
    """sum by (by) (rate(counter_total{selector}[$__rate_interval]))."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({_select(counter(name), selector)}[{RATE}]))"


def quantile(q: float, histogram: str, by: str = "", selector: str = "") -> str:
    """The q-quantile of a histogram over the rate window, per `by` labels."""
    labels = "le" + (f", {by}" if by else "")
    return f"histogram_quantile({q:g}, sum by ({labels}) (rate({_select(histogram + '_bucket', selector)}[{RATE}])))"


def or_zero(expr: str, like: str) -> str:
    """`expr`, or 0 for every series of `like` when `expr` has none (a counter whose labels only
    appear on the first error would otherwise show "No data" on a healthy run)."""
    return f"({expr}) or ({like} * 0)"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    exemplar: bool = False      # show trace-id exemplars (Grafana links them to Jaeger)


def _target(q: Query, ref: str) -> prometheus.Dataquery:
    t = prometheus.Dataquery().expr(q.expr).ref_id(ref).range()
    if q.legend:
        t = t.legend_format(q.legend)
    if q.exemplar:
        t = t.exemplar(True)
    return t


def jaeger_search_link(service: str) -> dashboard.DashboardLink:
    """A panel link that opens Grafana Explore on the Jaeger datasource, same time range."""
    left = {"datasource": JAEGER_UID,
            "queries": [{"refId": "A", "datasource": {"type": "jaeger", "uid": JAEGER_UID},
                         "queryType": "search", "service": service}],
            "range": {"from": "${__from}", "to": "${__to}"}}
    url = "/explore?left=" + urllib.parse.quote(json.dumps(left, separators=(",", ":")), safe="${}_")
    return (dashboard.DashboardLink(f"Traces of {service} (Jaeger)").type(DashboardLinkType.LINK)
            .url(url).target_blank(True))


def graph(title: str, queries: list[Query], unit: str = "short", description: str = "",
          width: int = 12, height: int = 8, stacked: bool = False, minimum: float | None = None,
          maximum: float | None = None, trace_service: str | None = None) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(description).datasource(PROMETHEUS).unit(unit)
         .span(width).height(height).line_width(1).fill_opacity(10).show_points(VisibilityMode.NEVER)
         .legend(common.VizLegendOptions().display_mode(LegendDisplayMode.TABLE)
                 .placement(LegendPlacement.BOTTOM).show_legend(True).calcs(["lastNotNull", "max"]))
         .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
    if stacked:
        p = p.stacking(common.StackingConfig().mode(StackingMode.NORMAL))
    if minimum is not None:
        p = p.min(minimum)
    if maximum is not None:
        p = p.max(maximum)
    if trace_service:
        p = p.links([jaeger_search_link(trace_service)])
    for i, q in enumerate(queries):
        p = p.with_target(_target(q, chr(ord("A") + i)))
    return p


def single(title: str, queries: list[Query], unit: str = "short", description: str = "",
           width: int = 6, height: int = 5) -> stat.Panel:
    p = (stat.Panel().title(title).description(description).datasource(PROMETHEUS).unit(unit)
         .span(width).height(height).graph_mode(BigValueGraphMode.AREA).color_mode(BigValueColorMode.VALUE)
         .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    for i, q in enumerate(queries):
        p = p.with_target(_target(q, chr(ord("A") + i)))
    return p


def row(title: str) -> dashboard.Row:
    return dashboard.Row(title)


def board(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (dashboard.Dashboard(title).uid(uid).description(description).tags(["kvlab"])
            .refresh("5s").time("now-15m", "now").timezone("browser").editable())
