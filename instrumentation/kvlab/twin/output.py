"""Everything a twin run writes, through the live runs' own writers, so the two sit side by side.

Per policy: <run>/<policy>/summary.json (the typed `Summary`) and requests.jsonl; for the run:
report.html (report/html.py) and compare.json / compare.html (report/compare.py), compare.json the
typed run document `kvlab compare` writes, with the twin's settings and what the router saw in its
`twin` section. Every page says it is from the twin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from kvlab.compare.results import Row, row
from kvlab.lifecycle import write_atomic
from kvlab.load.measure import Record
from kvlab.load.oracle import Oracle
from kvlab.load.summary import Summary
from kvlab.report.compare import write_compare
from kvlab.report.html import write_report
from kvlab.run.document import RunDocument, Section, write_run
from kvlab.run.phases import Phase, PhaseResult

SOURCE = "kvlab twin: virtual time, simulated replicas (not a live run)"
BANNER = (f'<p class="note" style="font-weight:bold">Every figure on this page is from the {SOURCE}; '
          "docs/twin.md says what it models.</p>")


def label_twin(html_path: Path, peers: str | None = None) -> None:
    """Put the twin banner under the page's heading (the renderers are the live runs'); `peers`:
    which other simulator made the rows marked (peer)."""
    text = html_path.read_text(encoding="utf-8")
    head, sep, rest = text.partition("</h1>")
    banner = BANNER.replace("</p>", f" The (peer) rows are from {peers}.</p>") if peers else BANNER
    html_path.write_text(head.replace("<h1>", "<h1>[twin] ", 1) + sep + banner + rest if sep else text,
                         encoding="utf-8")


def write_policy(run_dir: Path, policy: str, summary: Summary, records: list[Record]) -> Path:
    """<run>/<policy>/summary.json and requests.jsonl."""
    d = run_dir / policy
    d.mkdir(parents=True, exist_ok=True)
    write_atomic(d / "summary.json", summary.to_json())
    enc = msgspec.json.Encoder()
    with (d / "requests.jsonl").open("wb") as f:
        for r in records:
            f.write(enc.encode(r) + b"\n")
    return d


def compare_row(policy: str, summary: Summary, ceiling: Oracle | None, peer: bool = False) -> Row:
    """The compare.json row of one policy (replica counts from its own records; `peer`: another
    project's simulator made it, twin/dynamo.py)."""
    served = {k: float(v) for k, v in summary.replicas.items()}
    return row(policy, peer, summary, ceiling, {}, served, {})


def write_pages(run_dir: Path, twin: dict[str, Any], summaries: dict[str, Summary],
                records: dict[str, list[Record]], rows: list[Row], oracle_note: str,
                peers: str | None = None) -> dict[str, Path]:
    """compare.json (the run document, `twin` its settings), compare.html and report.html of a run
    whose policies' summaries are already written (`peers`: the source of its peer rows)."""
    workload = twin["workload"]
    section = Section(workload=workload, oracle_note=oracle_note, routers=rows)
    document = RunDocument(id=run_dir.name, run_dir=str(run_dir), scenario="twin", command=twin["command"],
                           engine="twin", replicas=twin["replicas"], workload=workload, users=twin["users"],
                           seed=twin["seed"], routers=list(summaries),
                           workloads={workload["name"]: section},
                           twin={k: v for k, v in twin.items() if k not in ("command", "workload", "users", "seed")})
    write_run(run_dir / "compare.json", document)
    cmp_html = write_compare(run_dir / "compare.html", document, {workload["name"]: records})
    phases = {p: PhaseResult(phase=Phase(p, p), dir=run_dir / p, summary=s, records=records[p])
              for p, s in summaries.items()}
    report = write_report(run_dir / "report.html", phases,
                          {"run": run_dir.name, "source": SOURCE, "workload": workload["name"],
                           "replicas": twin["replicas"], "seed": twin["seed"]})
    for page in (cmp_html, report):
        label_twin(page, peers)
    return {"compare": cmp_html, "report": report}


def write_stages(run_dir: Path, summaries: dict[str, Summary]) -> Path:
    """<run>/stages.html: a stepped ramp's per-stage TTFT p90, output throughput and false hits,
    one line per policy (load/stages.py), labelled as the twin's."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("TTFT p90 (s)", "output tokens/s", "predicted but not delivered / prompt"))
    for policy, s in summaries.items():
        rows = [st for st in s.stages or [] if not st.warmup]
        x = [f"{st.rate:g}" for st in rows]
        for i, y in enumerate(([st.ttft_p90_s for st in rows], [st.output_tok_s for st in rows],
                               [st.false_hit_rate for st in rows]), start=1):
            fig.add_trace(go.Scatter(x=x, y=y, name=policy, legendgroup=policy, showlegend=i == 1), row=i, col=1)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="stage rate (requests/s)", row=3, col=1)
    fig.update_layout(title=f"[twin] per-stage results ({SOURCE})", height=900)
    path = run_dir / "stages.html"
    write_atomic(path, fig.to_html(include_plotlyjs="cdn"))
    return path
