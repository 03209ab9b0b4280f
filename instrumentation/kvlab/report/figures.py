"""Plotly figures of a lab run; each takes {phase: records or summary} in phase order."""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

from kvlab.load.measure import Record
from kvlab.load.summary import Summary

COLORS = ["#d62728", "#2ca02c", "#1f77b4", "#ff7f0e", "#9467bd"]   # phase 1 red (before), 2 green (after)
Records = list[Record]
PLOT_CONFIG = {"displaylogo": False}

# what to look at in each of the report's own figures, under it
CAPTIONS = {
    "ttft_cdf": "Each line is one phase (or router): the share of its requests (up) whose first token came "
                "within the time across. Further left is faster. A cache hit pays prefill only for the uncached "
                "end of its prompt, a miss for every token, so hits and misses form two steps; the better router "
                "moves requests from the right step to the left one.",
    "hit_rates": "Fractions of prompt tokens, per phase. available: cached on some replica (what a perfect router "
                 "could reuse); predicted: cached on the replica the gateway chose; delivered: what the engine "
                 "reported reusing. The drop from available to predicted is cache lost to routing, from predicted "
                 "to delivered cache lost to eviction or a stale index.",
    "throughput": "Requests completed per second, in 2-s bins from each phase's start. Higher is better; both "
                  "phases start with empty caches, so watch where each settles.",
    "requests_per_replica": "How many requests each replica served in each phase. Round-robin is even by "
                            "construction; a cache-aware router follows the prompt groups, so its bars are as "
                            "uneven as the groups' sizes and its load scorers allow.",
    "ttft_by_replica_over_time": "Every request's TTFT (log scale) against when it was sent, one colour per phase. "
                                 "Cache misses are the slow band at the top: under a cache-aware router it thins "
                                 "out once each group's prefix is cached somewhere (hover a point for its replica "
                                 "and cached tokens).",
}


def figure_html(fig: go.Figure, caption: str, config: dict[str, Any] | None = None, div_id: str | None = None) -> str:
    """A figure for a report: its title as the HTML heading above the plot (plotly's toolbar sits in
    the plot's top corner and would cover a title drawn inside it) and a caption under it."""
    title = fig.layout.title.text or ""
    bare = go.Figure(fig).update_layout(title=None)
    if not bare.layout.annotations:          # subplot titles keep the margin they were drawn in
        bare.update_layout(margin={"t": 36})
    div = pio.to_html(bare, include_plotlyjs=False, full_html=False, config=config or PLOT_CONFIG, div_id=div_id)
    heading = html.escape(title).replace("&lt;br&gt;", " ")
    return (f'<figure class="fig"><h3>{heading}</h3>{div}'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _layout(fig: go.Figure, title: str, **kw: Any) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", height=380, margin=dict(l=60, r=20, t=50, b=50),
                      legend=dict(orientation="h", y=-0.2), **kw)
    return fig


def ttft_cdf(phases: Mapping[str, Records]) -> go.Figure:
    """Cumulative distribution of time to first token, one line per phase (log x axis)."""
    fig = go.Figure()
    for i, (phase, records) in enumerate(phases.items()):
        values = np.sort([r.ttft_ms for r in records if not r.error and r.ttft_ms is not None])
        if not len(values):
            continue
        y = np.arange(1, len(values) + 1) / len(values)
        fig.add_trace(go.Scatter(x=values, y=y, mode="lines", name=phase, line=dict(color=COLORS[i % 5], width=3),
                                 hovertemplate="TTFT %{x:.0f} ms<br>%{y:.0%} of requests<extra>" + phase + "</extra>"))
    fig.update_xaxes(type="log", title="TTFT (ms, log scale)")
    fig.update_yaxes(title="fraction of requests", tickformat=".0%", range=[0, 1.02])
    return _layout(fig, "TTFT CDF per phase (left is better)")


def throughput(phases: Mapping[str, Records], bin_s: float = 2.0, max_bins: int = 2000) -> go.Figure:
    """Completed requests per second over each phase's time (aligned at its start), in bins of
    `bin_s` seconds, wider where a phase would need more than `max_bins` of them (the twin's
    virtual time can span days)."""
    fig = go.Figure()
    for i, (phase, records) in enumerate(phases.items()):
        ok = [r for r in records if not r.error]
        if not ok:
            continue
        t0 = min(r.ts for r in records)
        ends = np.array([r.ts + r.e2e_ms / 1000 - t0 for r in ok])
        width = max(bin_s, float(ends.max()) / max_bins)
        edges = np.arange(0, ends.max() + width, width)
        counts, _ = np.histogram(ends, bins=edges)
        fig.add_trace(go.Scatter(x=edges[:-1] + width / 2, y=counts / width, mode="lines+markers", name=phase,
                                 line=dict(color=COLORS[i % 5], width=2, shape="hvh")))
    fig.update_xaxes(title="seconds since the phase started")
    fig.update_yaxes(title="requests / s", rangemode="tozero")
    return _layout(fig, "Throughput over time (higher is better)")


def requests_per_replica(phases: Mapping[str, Records]) -> go.Figure:
    """How each phase spread requests over replicas (round-robin: even; kv-aware: by prefix)."""
    counts = {p: Counter(r.replica or "?" for r in recs if not r.error) for p, recs in phases.items()}
    replicas = sorted({name for c in counts.values() for name in c})
    fig = go.Figure([go.Bar(name=p, x=replicas, y=[c.get(n, 0) for n in replicas], marker_color=COLORS[i % 5])
                     for i, (p, c) in enumerate(counts.items())])
    fig.update_yaxes(title="requests")
    return _layout(fig, "Requests per replica", barmode="group")


def hit_rates(summaries: Mapping[str, Summary]) -> go.Figure:
    """available / predicted / delivered prompt-token fractions per phase."""
    kinds = ["available", "predicted", "delivered"]
    fig = go.Figure()
    for i, (phase, s) in enumerate(summaries.items()):
        values = [s.hit_rate.available, s.hit_rate.predicted, s.hit_rate.delivered]
        fig.add_trace(go.Bar(name=phase, x=kinds, y=[v or 0 for v in values], marker_color=COLORS[i % 5],
                             text=[f"{v:.0%}" if v is not None else "n/a" for v in values], textposition="outside"))
    fig.update_yaxes(title="fraction of prompt tokens", tickformat=".0%", range=[0, 1.1])
    return _layout(fig, "Hit rates: available → predicted → delivered",
                   barmode="group")


def ttft_by_replica_over_time(phases: Mapping[str, Records]) -> go.Figure:
    """Every request's TTFT against time, per phase: misses stand out as the slow band."""
    fig = go.Figure()
    for i, (phase, records) in enumerate(phases.items()):
        ok = [r for r in records if not r.error and r.ttft_ms is not None]
        if not ok:
            continue
        t0 = min(r.ts for r in records)
        fig.add_trace(go.Scattergl(x=[r.ts - t0 for r in ok], y=[r.ttft_ms for r in ok], mode="markers",
                                   name=phase, marker=dict(color=COLORS[i % 5], size=4, opacity=0.6),
                                   text=[f"{r.replica} cached {r.cached_tokens}/{r.prompt_tokens}"
                                         for r in ok],
                                   hovertemplate="%{text}<br>TTFT %{y:.0f} ms<extra>" + phase + "</extra>"))
    fig.update_xaxes(title="seconds since the phase started")
    fig.update_yaxes(title="TTFT (ms, log scale)", type="log")
    return _layout(fig, "TTFT of every request over time")
