"""`kvlab report RUN_DIR`: a run's pages rendered again from the files it saved, so a report made
by an older kvlab (or deleted) comes back with today's renderer without re-running anything.

report.html from summary.json and each phase's phase-N-<name>/{summary.json, requests.jsonl,
autoscale.json}; compare.html (and the twin's report.html) from compare.json and each router's
requests.jsonl. The traces stay where the run wrote them: the mechanism section reads them again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec

from kvlab.load.measure import read_records
from kvlab.load.summary import read_summary
from kvlab.report.compare import write_compare
from kvlab.report.html import write_report
from kvlab.run.document import RunDocument, read_run
from kvlab.run.phases import Phase, PhaseResult


def _phase(d: Path, name: str) -> PhaseResult:
    summary = read_summary(d / "summary.json")
    timeline = msgspec.json.decode((d / "autoscale.json").read_bytes()) if (d / "autoscale.json").is_file() else None
    return PhaseResult(phase=Phase(name, summary.policy or name), dir=d, summary=summary,
                       records=read_records(d / "requests.jsonl"), autoscale=timeline)


def phases_in(d: Path, names: list[str] | None = None) -> dict[str, PhaseResult]:
    """The phases saved under `d`: `names`' folders (the twin's <policy>/), else phase-N-<name>/ in N order."""
    if names is not None:
        return {n: _phase(d / n, n) for n in names if (d / n / "summary.json").is_file()}
    numbered = [(int(p.name.split("-")[1]), p) for p in d.glob("phase-*-*")
                if p.name.split("-")[1].isdigit() and (p / "summary.json").is_file()]
    return {p.name.split("-", 2)[2]: _phase(p, p.name.split("-", 2)[2]) for _, p in sorted(numbered)}


def meta_of(doc: RunDocument, run_dir: Path) -> dict[str, Any]:
    """The report's meta line, from what the run document kept."""
    workload = doc.workload.get("name") if isinstance(doc.workload, dict) else doc.workload
    meta = {"run": doc.id or run_dir.name, "engine": doc.engine, "replicas": doc.replicas, "workload": workload,
            "seed": doc.seed, "users": doc.users, "seconds per phase": doc.duration_s}
    return {k: v for k, v in meta.items() if v is not None}


def render(run_dir: Path) -> list[Path]:
    """Write the run's pages again; the paths written ([] when the folder holds no run document)."""
    written = []
    if (run_dir / "summary.json").is_file():
        doc = read_run(run_dir / "summary.json")
        phases = phases_in(run_dir)
        if phases:
            written.append(write_report(run_dir / "report.html", phases, meta_of(doc, run_dir)))
    if (run_dir / "compare.json").is_file():
        doc = read_run(run_dir / "compare.json")
        if doc.scenario == "twin":
            from kvlab.twin.output import SOURCE, label_twin

            phases = phases_in(run_dir, doc.routers)
            [name] = doc.workloads
            pages = [write_compare(run_dir / "compare.html", doc, {name: {p: r.records for p, r in phases.items()}}),
                     write_report(run_dir / "report.html", phases, {**meta_of(doc, run_dir), "source": SOURCE})]
            for page in pages:
                label_twin(page)
            written += pages
        else:
            records = {w: {p: r.records for p, r in phases_in(run_dir / w).items()} for w in doc.workloads}
            written.append(write_compare(run_dir / "compare.html", doc, records))
    return written


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvlab report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run directory (runs/<id>) that kvlab lab, compare or twin wrote")
    args = p.parse_args(argv)
    try:
        written = render(args.run_dir)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"kvlab report: {args.run_dir}: {exc}", file=sys.stderr)
        return 1
    if not written:
        print(f"kvlab report: {args.run_dir}: no summary.json or compare.json with its phases", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
