"""compare.html: `kvlab compare`'s routers side by side, per workload (plotly.js inlined, opens offline)."""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path

import msgspec
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from kvlab.compare.results import COLUMNS, Row, cells, kv_path_warning
from kvlab.load.measure import Record
from kvlab.report import figures
from kvlab.report.html import CSS, PLOT_CONFIG
from kvlab.report.sweep import sweep_section
from kvlab.run.document import RunDocument


def hit_vs_oracle(rows: list[Row]) -> go.Figure:
    """Each router's engine hit rate next to the oracle's ceiling for the requests it completed."""
    x = [r.router for r in rows]
    fig = go.Figure([
        go.Bar(name="engine hit rate", x=x, y=[r.hit_rate or 0 for r in rows], marker_color=figures.COLORS[1],
               text=[f"{r.share_of_oracle:.0%} of oracle" if r.share_of_oracle is not None else "n/a" for r in rows],
               textposition="outside"),
        go.Bar(name="oracle", x=x, y=[r.oracle_hit_rate or 0 for r in rows], marker_color="#bbbbbb"),
    ])
    fig.update_yaxes(title="fraction of prompt tokens", tickformat=".0%", range=[0, 1.1])
    return figures._layout(fig, "Hit rate vs the oracle (higher is better)", barmode="group")


def ttft(rows: list[Row]) -> go.Figure:
    """TTFT p50 / p95 / p99 per router."""
    x = [r.router for r in rows]
    fig = go.Figure([go.Bar(name=q, x=x, y=[getattr(r, f"ttft_{q}_ms") or 0 for r in rows],
                            marker_color=figures.COLORS[i + 2]) for i, q in enumerate(("p50", "p95", "p99"))])
    fig.update_yaxes(title="TTFT (ms)")
    return figures._layout(fig, "Time to first token (lower is better)", barmode="group")


def throughput(rows: list[Row]) -> go.Figure:
    """Completed requests per second per router."""
    fig = go.Figure(go.Bar(x=[r.router for r in rows], y=[r.rps for r in rows], marker_color=figures.COLORS[2],
                           text=[f"{r.rps:.2f}" for r in rows], textposition="outside"))
    fig.update_yaxes(title="requests / s", rangemode="tozero")
    return figures._layout(fig, "Throughput (higher is better)")


def balance(rows: list[Row]) -> go.Figure:
    """Requests each replica served, per router (from the replicas' own counters), stacked."""
    replicas = sorted({n for r in rows for n in r.replica_requests})
    fig = go.Figure([go.Bar(name=n, x=[r.router for r in rows], y=[r.replica_requests.get(n, 0) for r in rows])
                     for n in replicas])
    fig.update_yaxes(title="requests")
    return figures._layout(fig, "Requests per replica", barmode="stack")


CAPTIONS: dict[Callable[[list[Row]], go.Figure], str] = {
    hit_vs_oracle: "Each router's engine hit rate (the share of prompt tokens its replicas reused) beside the "
                   "oracle's: the best any router could reach on the requests it completed with the same "
                   "caches. The label is the share of that ceiling reached.",
    ttft: "Time to first token, p50 / p95 / p99, per router. Lower is better; a tall p99 beside a short p50 is "
          "queueing behind cache misses or an overloaded replica.",
    throughput: "Completed requests per second per router. Higher is better; under a closed loop, faster answers "
                "mean more requests.",
    balance: "Requests each replica served per router, stacked (from the replicas' own counters). An even stack is "
             "a router that spreads load; a dominant colour is one replica taking most of it.",
}


def _div(figure: Callable[[list[Row]], go.Figure], rows: list[Row]) -> str:
    return figures.figure_html(figure(rows), CAPTIONS[figure], PLOT_CONFIG)


def _table(rows: list[Row]) -> str:
    head = "".join(f'<th title="{html.escape(what)}">{html.escape(h)}</th>' for h, what in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


NOTES = """<p class="note"><b>How to read this.</b> Every router saw the same replicas and the same seeded
workload, the replicas' prefix caches reset before each. <i>hit rate</i>: prompt tokens the engine served
from its cache; <i>oracle</i>: the most any router could get for the same requests on the same total cache
(Belady's replacement on one pooled cache, an upper bound); <i>balance</i>: requests each replica served,
counted by the replica. docs/compare.md explains every column.</p>"""


def render(document: RunDocument, records: dict[str, dict[str, list[Record]]]) -> str:
    """document: compare.json; records: {workload: {router: requests.jsonl records}}."""
    meta = " · ".join(html.escape(f"{k}: {v}") for k in ("id", "engine", "replicas", "users", "duration_s", "seed")
                      if (v := getattr(document, k)) is not None)
    sections = [sweep_section(sw) for sw in document.sweeps.values()]
    for w, section in document.workloads.items():
        rows = section.routers
        grid = "".join(_div(f, rows) for f in (hit_vs_oracle, ttft, throughput, balance))
        warnings = "".join(f'<p class="note">{html.escape(x)}</p>' for x in filter(None, map(kv_path_warning, rows)))
        cdf = figures.figure_html(figures.ttft_cdf(records[w]), figures.CAPTIONS["ttft_cdf"], PLOT_CONFIG)
        sections.append(f"<h2>{html.escape(w)}</h2><div class=\"meta\">{html.escape(section.oracle_note)}</div>"
                        f"{_table(rows)}{warnings}<div class=\"grid\">{grid}</div>{cdf}")
    data = msgspec.json.encode(document).decode().replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kvlab compare {html.escape(document.id)}</title>
<style>{CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>kvlab compare: {html.escape(', '.join(document.routers))}</h1>
<div class="meta">{meta}<br>{html.escape(document.command or '')}</div>
{''.join(sections)}
{NOTES}
<script type="application/json" id="kvlab-compare">{data}</script>
</body></html>
"""


def write_compare(path: Path, document: RunDocument, records: dict[str, dict[str, list[Record]]]) -> Path:
    path.write_text(render(document, records), encoding="utf-8")
    return path
