"""What a lab run leaves behind: runs/<id>/summary.json (a `RunDocument`), report.html and the printed table."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from kvlab.load.summary import Summary
from kvlab.load.table import summary_table
from kvlab.report import write_report
from kvlab.report.html import headline
from kvlab.run.document import RunDocument, write_run
from kvlab.run.phases import PhaseResult


def comparison(summaries: Mapping[str, Summary]) -> dict[str, float | None]:
    """Ratios of the last phase against the first (what the lab's checks and headline use)."""
    values = list(summaries.values())
    first, last = values[0], values[-1]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {
        "ttft_p50_speedup": ratio(first.ttft_ms.p50, last.ttft_ms.p50),
        "ttft_p95_speedup": ratio(first.ttft_ms.p95, last.ttft_ms.p95),
        "delivered_hit_rate_gain": ratio(last.hit_rate.delivered, first.hit_rate.delivered),
        "throughput_gain": ratio(last.rps, first.rps),
        "output_tok_s_gain": ratio(last.output_tok_s, first.output_tok_s),
    }


def finish(console: Console, run_dir: Path, results: list[PhaseResult], document: RunDocument,
           meta: dict[str, Any], traces: str) -> None:
    """runs/<id>/summary.json (`document` with the phases and their comparison) and report.html;
    prints the table."""
    phases = {r.phase.name: r for r in results}
    summaries = {p: v.summary for p, v in phases.items()}
    write_run(run_dir / "summary.json", msgspec.structs.replace(document, phases=summaries,
                                                                comparison=comparison(summaries)))
    report = write_report(run_dir / "report.html", phases, meta)
    console.print(summary_table(summaries, title="before → after"))
    console.print(f"[bold]{headline(summaries)}[/bold]")
    console.print(f"report:  {report}\nsummary: {run_dir / 'summary.json'}\ntraces:  {traces}")
