"""Grafana dashboards as code (grafana-foundation-sdk): `kvlab dashboards [--dashboards-dir DIR] [--check]`.

Writes dashboards/*.json ("Before / after", "Routing", "Replicas", "P/D and data parallel"), the
Grafana provisioning files under dashboards/provisioning/ and the Prometheus rules under
dashboards/rules/. `--check` writes nothing and
fails when the files on disk differ from what the code generates. `--verify PROMETHEUS_URL`
evaluates every panel query over the last `--since` seconds and fails on any query that errors
or returns no data (queries of metrics that open issues will add are reported, not failed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlab.vocabulary import old_spelling

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "dashboards"


def main(argv: list[str]) -> int:
    from kvlab.dashboards.catalog import render
    from kvlab.dashboards.schema import validate

    parser = argparse.ArgumentParser(prog="kvlab dashboards", description=__doc__.split("\n")[0])
    parser.add_argument("--dashboards-dir", type=Path, default=DEFAULT_OUT,
                        help=f"where the dashboards' JSON files go (default {DEFAULT_OUT})")
    old_spelling(parser, "--out", "--dashboards-dir", type=Path)
    parser.add_argument("--check", action="store_true",
                        help="compare with the files in --dashboards-dir, write nothing")
    parser.add_argument("--verify", metavar="PROMETHEUS_URL", help="evaluate every panel query there")
    parser.add_argument("--since", type=float, default=900, help="seconds back from now for --verify")
    args = parser.parse_args(argv)
    if args.verify:
        return _verify(args.verify, args.since)
    files = render()
    for name, text in files.items():
        if name.endswith(".json"):
            validate(json.loads(text))
    if args.check:
        stale = [name for name, text in files.items()
                 if not (args.dashboards_dir / name).is_file() or (args.dashboards_dir / name).read_text() != text]
        for name in stale:
            print(f"out of date: {args.dashboards_dir / name} (run `kvlab dashboards`)")
        return 1 if stale else 0
    for name, text in files.items():
        path = args.dashboards_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


def _verify(url: str, since_s: float) -> int:
    import time

    from rich.console import Console
    from rich.table import Table

    from kvlab.dashboards.verify import verify

    end = time.time()
    results = verify(url, end - since_s, end)
    table = Table(title=f"dashboard queries against {url}, last {since_s:.0f} s")
    for col in ("dashboard", "panel", "ref", "series", "result"):
        table.add_column(col)
    for r in results:
        verdict = "[green]ok[/]" if r.ok and not r.pending else (
            f"[yellow]pending: {r.pending}[/]" if r.pending else f"[red]{r.problem}[/]")
        table.add_row(r.uid, r.panel, r.ref, str(r.series), verdict)
    Console().print(table)
    return 0 if all(r.ok for r in results) else 1
