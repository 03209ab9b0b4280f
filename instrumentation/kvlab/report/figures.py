"""Plotly figures of a lab run; each takes {phase: records or summary} in phase order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go

from kvlab.load.measure import Record
from kvlab.load.summary import Summary

COLORS = ["#d62728", "#2ca02c", "#1f77b4", "#ff7f0e", "#9467bd"]   # phase 1 red (before), 2 green (after)
Records = list[Record]


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


def throughput(phases: Mapping[str, Records], bin_s: float = 2.0) -> go.Figure:
    """Completed requests per second over each phase's time (aligned at its start)."""
    fig = go.Figure()
    for i, (phase, records) in enumerate(phases.items()):
        ok = [r for r in records if not r.error]
        if not ok:
            continue
        t0 = min(r.ts for r in records)
        ends = np.array([r.ts + r.e2e_ms / 1000 - t0 for r in ok])
        edges = np.arange(0, ends.max() + bin_s, bin_s)
        counts, _ = np.histogram(ends, bins=edges)
        fig.add_trace(go.Scatter(x=edges[:-1] + bin_s / 2, y=counts / bin_s, mode="lines+markers", name=phase,
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
