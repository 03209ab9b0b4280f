"""The report's autoscaling section: load, desired vs running replicas and TTFT on one time axis.

Shown only for a phase that carries autoscaling data (the ramping-load scenario,
kvlab.scenarios.autoscale): `{"samples": [{t, desired, running, reason, ...}], "actions":
[{t, direction, replica, to, reason, ready_ms}], "users": [[t, users], ...], "ramp": {...}}`.
Times are aligned at the phase's first request, like the other figures.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.load.measure import Record
from kvlab.report.figures import figure_html
from kvlab.run.phases import PhaseResult

FIGURE_ID = "kvlab-autoscale"
BIN_S = 2.0


def figure(data: dict[str, Any], records: list[Record]) -> go.Figure:
    """Three rows sharing x: users and completed req/s; desired vs running replicas with the scale
    actions marked; every request's TTFT with its 2-second median."""
    t0 = min([r.ts for r in records] or [s["t"] for s in data["samples"]] or [0.0])
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("Load", "Replicas: desired (gateway) vs running (scaler)",
                                        "TTFT of every request"))
    users = [(t - t0, u) for t, u in data.get("users", [])]
    if users:
        fig.add_trace(go.Scatter(x=[t for t, _ in users], y=[u for _, u in users], name="Locust users",
                                 mode="lines", line=dict(color="#7f7f7f", width=2, shape="hv")), row=1, col=1)
    ok = [r for r in records if not r.error and r.ttft_ms is not None]
    if ok:
        ends = np.array([r.ts + r.e2e_ms / 1000 - t0 for r in ok])
        edges = np.arange(0, ends.max() + BIN_S, BIN_S)
        counts, _ = np.histogram(ends, bins=edges)
        fig.add_trace(go.Scatter(x=edges[:-1] + BIN_S / 2, y=counts / BIN_S, name="completed req/s",
                                 mode="lines", line=dict(color="#1f77b4", width=2)), row=1, col=1)
    samples = data.get("samples", [])
    x = [s["t"] - t0 for s in samples]
    fig.add_trace(go.Scatter(x=x, y=[s["desired"] for s in samples], name="desired replicas", mode="lines",
                             line=dict(color="#d62728", width=3, dash="dash", shape="hv"),
                             text=[s.get("reason", "") for s in samples],
                             hovertemplate="desired %{y} (%{text})<extra></extra>"), row=2, col=1)
    fig.add_trace(go.Scatter(x=x, y=[s["running"] for s in samples], name="running replicas", mode="lines",
                             line=dict(color="#2ca02c", width=3, shape="hv")), row=2, col=1)
    actions = data.get("actions", [])
    if actions:
        fig.add_trace(go.Scatter(
            x=[a["t"] - t0 for a in actions], y=[a["to"] for a in actions], mode="markers+text",
            name="scale actions", text=[f"{a['direction']} → {a['to']}" for a in actions],
            textposition="top center", marker=dict(symbol=["triangle-up" if a["direction"] == "up" else "triangle-down"
                                                           for a in actions], size=12, color="#000"),
            hovertext=[f"{a['replica']}: {a['reason']}, {a['ready_ms']:.0f} ms" for a in actions],
            hoverinfo="text"), row=2, col=1)
    if ok:
        fig.add_trace(go.Scattergl(x=[r.ts - t0 for r in ok], y=[r.ttft_ms for r in ok], mode="markers",
                                   name="TTFT", marker=dict(color="#9467bd", size=4, opacity=0.5),
                                   text=[str(r.replica) for r in ok],
                                   hovertemplate="%{text}<br>TTFT %{y:.0f} ms<extra></extra>"), row=3, col=1)
        sent = np.array([r.ts - t0 for r in ok])
        ttft = np.array([r.ttft_ms for r in ok])
        bins = np.floor(sent / BIN_S).astype(int)
        mids = sorted(set(bins.tolist()))
        fig.add_trace(go.Scatter(x=[(b + 0.5) * BIN_S for b in mids],
                                 y=[float(np.median(ttft[bins == b])) for b in mids], name="TTFT median (2 s)",
                                 mode="lines", line=dict(color="#ff7f0e", width=3)), row=3, col=1)
    fig.update_yaxes(title_text="users · req/s", rangemode="tozero", row=1, col=1)
    top = max([s["desired"] for s in samples] + [s["running"] for s in samples] + [1])
    fig.update_yaxes(title_text="replicas", range=[0, top + 0.8], dtick=1, row=2, col=1)
    fig.update_yaxes(title_text="TTFT (ms, log)", type="log", row=3, col=1)
    fig.update_xaxes(title_text="seconds since the load started", row=3, col=1)
    fig.update_layout(template="plotly_white", height=820, margin=dict(l=60, r=20, t=60, b=50),
                      legend=dict(orientation="h", y=-0.08),
                      title="Autoscaling: load → recommendation → scale-up → effect → scale-down")
    return fig


def section(phases: Mapping[str, PhaseResult], config: dict[str, Any] | None = None) -> str:
    """HTML for every phase with autoscaling data (empty string when there is none)."""
    parts = []
    for phase, v in phases.items():
        data = v.autoscale
        if not data:
            continue
        s = data.get("settings", {})
        rows = "".join(f"<tr><td>{a['direction']}</td><td>{html.escape(a['replica'])}</td><td>{a['to']}</td>"
                       f"<td>{html.escape(a['reason'])}</td><td>{a['ready_ms']:.0f}</td></tr>"
                       for a in data.get("actions", []))
        caption = (
            "Top: the Locust users (the ramp) and completed requests per second. Middle: the "
            "gateway's desired-replica recommendation (kvlab_gateway_desired_replicas, hover for its "
            "reason) and the replicas the stack's scaler runs; triangles are scaling actions "
            "(stack.scale spans in the traces). Bottom: TTFT of every request and its median. "
            "Read it left to right: users rise, the queue grows, the recommendation rises, a replica starts "
            "(seconds later: process start), TTFT falls back; once the load drops the recommendation waits "
            f"the scale-down window ({s.get('scale_down_window_s', '?')} s) and the added replicas stop. "
            "See docs/autoscaling.md.")
        parts.append(
            f"<h2>Autoscaling under a load ramp ({html.escape(phase)})</h2>"
            + figure_html(figure(data, v.records), caption, config, div_id=FIGURE_ID) +
            "<table><tr><th>action</th><th>replica</th><th>replicas after</th><th>reason</th><th>took (ms)</th></tr>"
            f"{rows}</table>")
    return "".join(parts)
