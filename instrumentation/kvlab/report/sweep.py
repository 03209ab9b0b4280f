"""A rate sweep in HTML: the table, each router's saturation knee, and its curves against the offered rate."""

from __future__ import annotations

import html

import plotly.graph_objects as go

from kvlab.compare.sweep import HEADERS, Sweep, behind, knees, rows_of
from kvlab.report import figures

CAPTIONS = ("Each router's TTFT p99 (solid) and p50 (dotted) at each offered rate. Lower is better; the rate "
            "where a curve turns up steeply is its saturation knee.",
            "The 99th percentile of the gaps between streamed tokens at each offered rate: how smooth streaming stays "
            "as the replicas fill. Lower is better.",
            "Completed requests per second (dotted) and goodput, those within the SLO above (solid), against the "
            "offered rate; the grey diagonal is the offered rate itself. A router keeps up while its goodput follows "
            "the diagonal.")


def curves(s: Sweep) -> list[go.Figure]:
    """Per router against the offered rate: TTFT p50/p99, ITL p99, throughput and goodput."""
    out = []
    for title, lines, axis in (
            ("TTFT vs offered rate (lower is better)", (("p99", "ttft_p99_ms", "solid"), ("p50", "ttft_p50_ms", "dot")),
             "TTFT (ms)"),
            ("ITL p99 vs offered rate (lower is better)", (("p99", "itl_p99_ms", "solid"),), "ITL (ms)"),
            ("Throughput and goodput vs offered rate",
             (("completed", "rps", "dot"), ("goodput", "goodput_rps", "solid")), "requests / s")):
        fig = go.Figure()
        for i, c in enumerate(s.curves):
            x, color = [p.offered_rps for p in c.points], figures.COLORS[i % len(figures.COLORS)]
            for label, field, dash in lines:
                fig.add_trace(go.Scatter(x=x, y=[getattr(p, field) for p in c.points], mode="lines+markers",
                                         name=f"{c.router} {label}", line={"dash": dash, "color": color}))
        if axis == "requests / s":
            top = max((p.offered_rps for c in s.curves for p in c.points), default=1.0)
            fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="offered",
                                     line={"color": "#bbbbbb", "dash": "dash"}))
        fig.update_xaxes(title="offered rate (requests / s)")
        fig.update_yaxes(title=axis, rangemode="tozero")
        out.append(figures._layout(fig, title))
    return out


def sweep_section(s: Sweep) -> str:
    """The sweep's table, knees and curves (compare.html and a lab's report.html)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells_) + "</tr>" for cells_ in rows_of(s))
    slo = f"goodput SLO: TTFT ≤ {s.slo.ttft_ms:g} ms and TPOT ≤ {s.slo.tpot_ms:g} ms"
    late = '<p class="note">The dispatcher fell behind at some rates (the <i>late</i> column): those rows ' \
           'understate the offered load.</p>' if behind(s) else ""
    return (f"<h2>{html.escape(s.workload)}: rate sweep</h2><div class=\"meta\">{html.escape(slo)} · saturation "
            f"knee: {html.escape(knees(s))}</div><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"{late}<div class=\"grid\">{''.join(map(figures.figure_html, curves(s), CAPTIONS))}</div>")
