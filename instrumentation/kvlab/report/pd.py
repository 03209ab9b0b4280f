"""The report's prefill/decode section: latency by P/D decision and by prompt kind, per phase,
and the CDF of each request's worst inter-token gap (the decode stalls P/D exists to remove).

Shown only when the gateway made P/D decisions (records carry `pd`, from `x-kvlab-pd-decision`).
The baseline phase (P/D off) has no decision; its rows are grouped by prompt kind alone, so the
same prompts can be compared across phases (docs/pd.md explains how to read it).
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go

from kvlab.load.measure import Record
from kvlab.report.figures import COLORS, Records, _layout, figure_html


def _p(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q):.0f}" if values else "–"


def _kind(r: Record) -> str:
    return "long uncached" if r.group == "long" else "shared prefix"


def _values(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def worst_gap_cdf(phases: Mapping[str, Records]) -> go.Figure:
    """Per phase, the cumulative distribution of each request's worst gap between two tokens
    (solid: every request; dotted: the shared-prefix requests, which never need a split)."""
    fig = go.Figure()
    for i, (phase, records) in enumerate(phases.items()):
        ok = [r for r in records if not r.error and r.itl_max_ms is not None]
        for subset, dash, label in ((ok, "solid", phase),
                                    ([r for r in ok if _kind(r) == "shared prefix"], "dot", f"{phase}, shared prefix")):
            values = np.sort(_values(r.itl_max_ms for r in subset))
            if not len(values):
                continue
            y = np.arange(1, len(values) + 1) / len(values)
            fig.add_trace(go.Scatter(x=values, y=y, mode="lines", name=label,
                                     line=dict(color=COLORS[i % 5], width=3 if dash == "solid" else 2, dash=dash),
                                     hovertemplate="worst gap %{x:.0f} ms<br>%{y:.0%} of requests<extra>"
                                                   + html.escape(label) + "</extra>"))
    fig.update_xaxes(type="log", title="the request's worst gap between two tokens (ms, log scale)")
    fig.update_yaxes(title="fraction of requests", tickformat=".0%", range=[0, 1.02])
    return _layout(fig, "Decode stalls: CDF of each request's worst inter-token gap (left is smoother)")


def section(records: Mapping[str, Records], plot_config: dict[str, Any] | None = None) -> str:
    """HTML table and figure (empty string when no phase made P/D decisions)."""
    if not any(r.pd for recs in records.values() for r in recs):
        return ""
    rows = []
    for phase, recs in records.items():
        groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
        for r in recs:
            if not r.error:
                groups[(_kind(r), r.pd or "off")].append(r)
        for (kind, pd), rs in sorted(groups.items()):
            ttft, itl = _values(r.ttft_ms for r in rs), _values(r.itl_ms for r in rs)
            worst = _values(r.itl_max_ms for r in rs)
            gaps = [g for r in rs for g in r.itl_gaps_ms or ()]
            e2e = [r.e2e_ms for r in rs]
            rows.append(f"<tr><td>{html.escape(phase)}</td><td>{kind}</td><td>{pd}</td><td>{len(rs)}</td>"
                        f"<td>{_p(ttft, 50)}</td><td>{_p(ttft, 95)}</td><td>{_p(itl, 50)}</td>"
                        f"<td>{_p(gaps, 99)}</td><td>{_p(worst, 50)}</td><td>{_p(worst, 95)}</td>"
                        f"<td>{_p(e2e, 50)}</td></tr>")
    figure = figure_html(worst_gap_cdf(records), "Each request's longest wait between two streamed tokens, as a CDF "
                         "per phase: further left is smoother. A long prefill that shares an engine step with a "
                         "stream stalls it; compare where the curves' tails end.", plot_config)
    return ("<h2>Prefill/decode disaggregation</h2>"
            "<p>Per phase, prompt kind and the gateway's P/D decision (<i>off</i>: P/D disabled; "
            "<i>fallback</i>: the prefill call failed and the request was served unified). "
            "Times in ms. <i>ITL p99</i> is over every gap between two tokens of those requests; "
            "<i>worst gap</i> is each request's longest wait for a next token: a decode stall, e.g. "
            "a long prefill sharing the engine step, which a mean ITL hides. See docs/pd.md.</p>"
            "<table><tr><th>phase</th><th>prompts</th><th>P/D</th><th>requests</th><th>TTFT p50</th>"
            "<th>TTFT p95</th><th>ITL p50</th><th>ITL p99</th><th>worst gap p50</th><th>worst gap p95</th>"
            "<th>e2e p50</th></tr>"
            + "".join(rows) + "</table>" + figure)
