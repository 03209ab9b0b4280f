"""`kvlab report RUN_DIR` renders a run's pages again from its saved files, the same pages the run wrote."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
from rich.console import Console

from conftest import phase_result
from kvlab import cli
from kvlab.load.measure import Record
from kvlab.report.outcome import finish
from kvlab.run.document import RunDocument
from kvlab.twin import cli as twin_cli


def _summary_json(page: Path) -> str:
    return re.search(r'id="kvlab-summary">(.*?)</script>', page.read_text(), re.S).group(1)


def _heading(page: Path) -> str:
    return re.search(r"<h1>(.*?)</h1>", page.read_text()).group(1)


def _records(hit: bool) -> list[Record]:
    return [Record(ts=1000 + i * 0.1, ttft_ms=40.0 if hit else 400.0, itl_ms=12.0, tpot_ms=12.0, e2e_ms=600.0,
                   prompt_tokens=1000, output_tokens=16, cached_tokens=900 if hit else 0, available_tokens=900,
                   predicted_tokens=900 if hit else 0, replica=f"sim-{i % 2}", error=None) for i in range(40)]


def test_a_lab_run_gets_its_report_back(tmp_path):
    run = tmp_path / "run"
    results = []
    for n, (name, hit) in enumerate((("round-robin", False), ("kv-aware", True)), 1):
        r = phase_result(name, _records(hit))
        d = run / f"phase-{n}-{name}"
        d.mkdir(parents=True)
        r = msgspec.structs.replace(r, dir=d, summary=msgspec.structs.replace(r.summary, policy=name))
        (d / "summary.json").write_bytes(msgspec.json.encode(r.summary))
        (d / "requests.jsonl").write_bytes(b"\n".join(msgspec.json.encode(x) for x in r.records))
        results.append(r)
    finish(Console(file=open("/dev/null", "w")), run, results,   # noqa: SIM115 (closed with the console)
           RunDocument(id="run", engine="sim", replicas=2, workload={"name": "shared-prefix"}, users=4),
           {"run": "run", "engine": "sim", "replicas": 2, "workload": "shared-prefix", "users": 4}, "off")
    written = run / "report.html"
    summary, heading = _summary_json(written), _heading(written)
    written.unlink()
    assert cli.main(["report", str(run)]) == 0
    assert _summary_json(written) == summary and _heading(written) == heading == "kvlab: round-robin vs kv-aware"
    assert "users: 4" in written.read_text()


def test_a_twin_run_gets_both_pages_back_labelled(tmp_path):
    run = tmp_path / "twin"
    assert twin_cli.main(["--policy", "round-robin,kv-aware", "--replicas", "2", "--requests", "20",
                          "--workload", "shared-prefix", "--out", str(run)]) == 0
    before = {p: _summary_json(run / p) if p == "report.html" else (run / p).read_text().count("Plotly.newPlot")
              for p in ("report.html", "compare.html")}
    for page in before:
        (run / page).unlink()
    assert cli.main(["report", str(run)]) == 0
    assert _summary_json(run / "report.html") == before["report.html"]
    assert (run / "compare.html").read_text().count("Plotly.newPlot") == before["compare.html"]
    assert all(_heading(run / p).startswith("[twin] ") for p in before)


def test_a_folder_without_a_run_is_refused(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no summary.json or compare.json" in capsys.readouterr().err
