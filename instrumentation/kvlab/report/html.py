"""Render the lab report: one HTML file with plotly.js inlined, so it opens offline."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from plotly.offline import get_plotlyjs

from kvlab.compare.sweep import from_summaries
from kvlab.load.summary import Summary
from kvlab.load.table import ROWS
from kvlab.report import figures
from kvlab.report.autoscale import section as autoscale_section
from kvlab.report.pd import section as pd_section
from kvlab.report.sweep import sweep_section
from kvlab.run.phases import PhaseResult
from kvlab.traces.mechanism import section as mechanism_section

PLOT_CONFIG = figures.PLOT_CONFIG


def _table(summaries: Mapping[str, Summary]) -> str:
    head = "".join(f"<th>{html.escape(p)}</th>" for p in summaries)
    rows = []
    for label, metric, fmt, _ in ROWS:
        cells = "".join(f"<td>{fmt.format(v) if (v := metric(s)) is not None else 'n/a'}</td>"
                        for s in summaries.values())
        rows.append(f"<tr><th>{html.escape(label)}</th>{cells}</tr>")
    return f"<table><thead><tr><th>metric</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def headline(summaries: Mapping[str, Summary]) -> str:
    """One sentence comparing the first and last phase (TTFT p50, delivered hit rate, throughput)."""
    if len(summaries) < 2:
        return ""
    (p1, a), (p2, b) = list(summaries.items())[0], list(summaries.items())[-1]
    t1, t2 = a.ttft_ms.p50, b.ttft_ms.p50
    d1, d2 = a.hit_rate.delivered, b.hit_rate.delivered
    r1, r2 = a.rps, b.rps
    parts = []
    if t1 and t2:
        parts.append(f"TTFT p50 {t1:.0f} ms → {t2:.0f} ms ({t1 / t2:.1f}× lower)")
    if d1 is not None and d2 is not None:
        parts.append(f"delivered hit rate {d1:.0%} → {d2:.0%}")
    if r1 and r2:
        parts.append(f"throughput {r1:.1f} → {r2:.1f} req/s ({r2 / r1:.1f}×)")
    return f"{p1} → {p2}: " + "; ".join(parts)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222}
h1{font-size:1.6em;margin-bottom:.2em} .meta{color:#666;font-size:.9em}
.headline{font-size:1.15em;background:#f3f8f3;border-left:4px solid #2ca02c;padding:10px 14px;margin:16px 0}
table{border-collapse:collapse;margin:12px 0} td,th{border-bottom:1px solid #ddd;padding:4px 12px;text-align:right}
th:first-child{text-align:left} .grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.note{color:#444;font-size:.92em;max-width:70em}
figure.fig{margin:8px 0 16px} figure.fig h3{font-size:1em;margin:4px 0 0 8px}
figcaption{color:#444;font-size:.88em;margin:2px 8px 0;max-width:70em}
"""

NOTES = """
<p class="note"><b>How to read this.</b> Every phase replays the same seeded workload against the same
replicas, whose prefix caches are reset before each phase: only the routing changes. The table compares
the phases; under each figure a caption says what to look at. The figures, top to bottom: the TTFT CDF
(how fast first tokens came), the hit-rate decomposition (where prompt tokens were cached, and where the
cache was lost), throughput over time, requests per replica (how each router spread the load), every
request's TTFT over time, and, under "Why", the mechanism in this run: chained block hashes (why only
prefixes are reusable) and where each prompt group's blocks lived (which replicas held which group).
Traces of every request are under the run directory (<code>kvlab traces explain</code>).</p>
"""


def title(phases: Mapping[str, PhaseResult]) -> str:
    """The report's heading: the phases it compares, e.g. "kvlab: round-robin vs kv-aware"."""
    ramp = " under a load ramp, autoscaled" if any(v.autoscale for v in phases.values()) else ""
    return f"kvlab: {' vs '.join(phases)}{ramp}"


def render(phases: Mapping[str, PhaseResult], meta: dict[str, Any], run_dir: Path | None = None) -> str:
    """phases: {name: its result} in run order; meta: run id, workload, ...;
    run_dir: the run's files (traces, summary.json) for the mechanism section, if any."""
    summaries = {p: v.summary for p, v in phases.items()}
    records = {p: v.records for p, v in phases.items()}
    figs = {"ttft_cdf": figures.ttft_cdf(records), "hit_rates": figures.hit_rates(summaries),
            "throughput": figures.throughput(records), "requests_per_replica": figures.requests_per_replica(records)}
    divs = [figures.figure_html(f, figures.CAPTIONS[name]) for name, f in figs.items()]
    wide = figures.figure_html(figures.ttft_by_replica_over_time(records),
                               figures.CAPTIONS["ttft_by_replica_over_time"])
    summary_json = json.dumps(msgspec.to_builtins(summaries)).replace("</", "<\\/")  # safe inside <script>
    meta_line = " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kvlab report {html.escape(str(meta.get('run', '')))}</title>
<style>{CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>{html.escape(title(phases))}</h1>
<div class="meta">{meta_line}</div>
<div class="headline">{html.escape(headline(summaries))}</div>
{_table(summaries)}
{sweep_section(sweep) if (sweep := from_summaries(str(meta.get("workload", "")), summaries)) else ""}
{pd_section(records, PLOT_CONFIG)}
{autoscale_section(phases, PLOT_CONFIG)}
{NOTES}
<div class="grid">{''.join(divs)}</div>
{wide}
{mechanism_section(run_dir, phases, PLOT_CONFIG)}
<script type="application/json" id="kvlab-summary">{summary_json}</script>
</body></html>
"""


def write_report(path: str | Path, phases: Mapping[str, PhaseResult], meta: dict[str, Any]) -> Path:
    """Write the report to `path` and return it."""
    out = Path(path)
    out.write_text(render(phases, meta, out.parent), encoding="utf-8")
    return out
