"""Plotly views of traces: the waterfall of one trace, "why this replica" for one routing
decision, and the run's hit-rate decomposition against client TTFT; `write_html` puts any of
them in one self-contained page (plotly.js embedded once, opens offline)."""

from __future__ import annotations

import html
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from kvlab.telemetry import names as n
from kvlab.traces.decision import Decision
from kvlab.traces.explain import visible_scorers
from kvlab.traces.hitrate import RequestHits, summarize
from kvlab.traces.span import Span, Trace

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]
CHOSEN = "#E45756"
OTHER = "#9DB4CF"
INDENT = "· "      # tick labels are right-aligned: depth must be visible, not blank
_HOVER_KEYS = (n.REPLICA, n.POLICY, n.SCHEDULE_CHOSEN, n.SCHEDULE_REASON, n.PROMPT_TOKENS,
               n.PREFIX_AVAILABLE_TOKENS, n.PREFIX_PREDICTED_TOKENS, n.PREFIX_DELIVERED_TOKENS,
               n.ENGINE_CACHED_TOKENS, n.ENGINE_COMPUTED_TOKENS, n.ENGINE_QUEUE_MS, n.ENGINE_BATCH_SIZE,
               n.PD_DECISION, n.HTTP_RESPONSE_STATUS_CODE, n.ERROR_TYPE)


def _hover(span: Span) -> str:
    lines = [f"<b>{html.escape(span.service)}</b> {html.escape(span.name)} ({span.kind})",
             f"{span.duration_ms:.2f} ms"]
    lines += [f"{k} = {html.escape(str(span.attributes[k]))}" for k in _HOVER_KEYS if k in span.attributes]
    if span.status == "error":
        lines.append(f"<b>error</b> {html.escape(span.status_message)}")
    return "<br>".join(lines)


def waterfall_figure(trace: Trace) -> go.Figure:
    """One bar per span at its offset from the trace start, children under their parent,
    coloured by service."""
    rows = trace.walk()
    t0 = trace.start_ns
    colors = {svc: PALETTE[i % len(PALETTE)] for i, svc in enumerate(trace.services)}
    fig = go.Figure()
    labels = [INDENT * depth + (s.name if s.role == s.name else f"{s.name} ({s.role})") for depth, s in rows]
    for svc in trace.services:
        idx = [i for i, (_, s) in enumerate(rows) if s.service == svc]
        fig.add_trace(go.Bar(
            orientation="h", name=svc, marker_color=colors[svc],
            y=idx,
            base=[(rows[i][1].start_ns - t0) / 1e6 for i in idx],
            x=[max(rows[i][1].duration_ms, trace.duration_ms / 400) for i in idx],
            text=[f"{rows[i][1].duration_ms:.1f} ms" for i in idx], textposition="auto",
            hovertext=[_hover(rows[i][1]) for i in idx], hoverinfo="text",
            marker_line_color=["#000" if rows[i][1].status == "error" else colors[svc] for i in idx],
        ))
    # rows by index (two spans may share a name), first span on top
    fig.update_yaxes(tickvals=list(range(len(rows))), ticktext=labels, autorange="reversed", title=None)
    fig.update_xaxes(title="ms since the trace started")
    root = trace.root
    fig.update_layout(
        title=f"Trace {trace.trace_id[:16]}… {root.name}: {trace.duration_ms:.1f} ms, "
              f"{len(trace)} spans, {len(trace.services)} services",
        barmode="overlay", height=120 + 30 * len(rows), template="plotly_white",
        legend_title="service", margin=dict(l=10, r=10, t=60, b=40))
    return fig


def decision_figure(d: Decision, all_scorers: bool = False) -> go.Figure:
    """Candidates × scorer scores (heatmap; zero-weight scorers only with `all_scorers`), weighted
    totals and cached prefix per candidate; the chosen replica highlighted."""
    cands = d.candidates
    scorers = visible_scorers(d, all_scorers)
    labels = [f"★ {c.replica}" if c.chosen else c.replica for c in cands]
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, column_widths=[0.5, 0.25, 0.25],
                        horizontal_spacing=0.03,
                        subplot_titles=("scorer scores", "total (weighted)", "cached prefix, tokens"))
    if scorers:
        z = [[c.scores.get(s) for s in scorers] for c in cands]
        fig.add_trace(go.Heatmap(
            z=z, x=[f"{s} ×{d.weights[s]:g}" if s in d.weights else s for s in scorers], y=labels,
            colorscale=[[0.0, "#F7FBFF"], [1.0, "#6BAED6"]], zmin=0.0, zmax=1.0, showscale=False,
            texttemplate="%{z:.2f}", textfont=dict(color="#111"),
            hovertemplate="%{y}<br>%{x}: %{z:.3f}<extra></extra>"), row=1, col=1)
    colors = [CHOSEN if c.chosen else OTHER for c in cands]
    fig.add_trace(go.Bar(orientation="h", y=labels, x=[c.total or 0.0 for c in cands], marker_color=colors,
                         text=[f"{c.total:.3f}" if c.total is not None else "–" for c in cands],
                         textposition="auto", showlegend=False,
                         hovertemplate="%{y}: total %{x:.3f}<extra></extra>"), row=1, col=2)
    fig.add_trace(go.Bar(orientation="h", y=labels, x=[c.prefix_tokens or 0 for c in cands], marker_color=colors,
                         text=[str(c.prefix_tokens) if c.prefix_tokens is not None else "–" for c in cands],
                         textposition="auto", showlegend=False,
                         hovertemplate="%{y}: %{x} cached prefix tokens<extra></extra>"), row=1, col=3)
    if d.prompt_tokens:
        fig.add_vline(x=d.prompt_tokens, line_dash="dot", line_color="#555", row=1, col=3,
                      annotation_text=f"prompt {d.prompt_tokens}", annotation_position="bottom left")
    fig.update_yaxes(autorange="reversed")    # candidates top to bottom in the gateway's order
    shadow = " — shadow scores: the policy did not use them" if d.shadow else ""
    fig.update_layout(
        title=(f"Why {d.chosen}? policy {d.policy}, reason {d.reason}{shadow}<br>"
               f"<sup>prompt {_num(d.prompt_tokens)} tokens · available {_num(d.available)} · "
               f"predicted {_num(d.predicted)} · delivered {_num(d.delivered)} · "
               f"routing {d.routing_ms:.2f} ms · trace {d.trace_id}</sup>"),
        height=220 + 40 * len(cands), template="plotly_white", margin=dict(l=10, r=10, t=90, b=30))
    return fig


def _num(value: Any) -> str:
    return "?" if value is None else str(value)


def hitrate_figure(rows: Iterable[RequestHits]) -> go.Figure:
    """Per policy: available / predicted / delivered fractions of prompt tokens; per request:
    delivered fraction against client TTFT."""
    rows = list(rows)
    stats = summarize(rows)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.4, 0.6], horizontal_spacing=0.1,
                        subplot_titles=("hit rate by policy (fraction of prompt tokens)",
                                        "per request: delivered hit rate vs client TTFT"))
    kinds = [("available", "#9DB4CF"), ("predicted", "#4C78A8"), ("delivered", "#54A24B")]
    policies = list(stats)
    for kind, color in kinds:
        fig.add_trace(go.Bar(x=policies, y=[stats[p][kind] for p in policies], name=kind, marker_color=color,
                             text=[f"{stats[p][kind]:.0%}" for p in policies], textposition="auto",
                             legendgroup="kinds"), row=1, col=1)
    for i, policy in enumerate(policies):
        rs = [r for r in rows if (r.policy or "?") == policy and r.ttft_ms is not None]
        fig.add_trace(go.Scatter(
            x=[r.delivered / r.prompt_tokens if r.prompt_tokens else 0 for r in rs], y=[r.ttft_ms for r in rs],
            mode="markers", name=f"{policy} requests",
            marker=dict(color=PALETTE[i % len(PALETTE)], size=6, opacity=0.7),
            hovertext=[f"{r.trace_id}<br>{r.replica}: available {r.available}, predicted {r.predicted}, "
                       f"delivered {r.delivered} of {r.prompt_tokens}" for r in rs], hoverinfo="text+y"),
            row=1, col=2)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.05], row=1, col=1)
    fig.update_xaxes(tickformat=".0%", title="delivered / prompt tokens", row=1, col=2)
    fig.update_yaxes(title="client TTFT, ms", row=1, col=2)
    fig.update_layout(barmode="group", height=460, template="plotly_white",
                      title="Hit-rate decomposition: what was cached anywhere, what routing aimed at, "
                            "what the engine reused",
                      margin=dict(l=10, r=10, t=80, b=40))
    return fig


def write_html(figures: list[go.Figure], out: Path, title: str = "kvlab traces") -> Path:
    """All `figures` in one self-contained HTML page (no network needed to open it)."""
    parts = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False})
             for i, fig in enumerate(figures)]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:16px;background:#fff}</style></head><body>"
            f"<h2>{html.escape(title)}</h2>" + "\n".join(parts) + "</body></html>")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
