"""End to end: `kvlab lab --quick` shows the KV-aware win on the default workload and writes the report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import QuickLab
from kvlab.process import runs_command
from kvlab.stack.base import read_info
from kvlab.telemetry import names

pytestmark = pytest.mark.slow


def spans_of(traces_dir: Path, trace_id: str) -> dict[str, set[str]]:
    """service name -> span roles of one trace, from the OTLP JSON files of the run (a GenAI span's
    role is its `kvlab.span.role`, its name is `{operation} {model}`)."""
    found: dict[str, set[str]] = {}
    for f in traces_dir.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            for rs in json.loads(line).get("resourceSpans", []):
                service = next(a["value"]["stringValue"] for a in rs["resource"]["attributes"]
                               if a["key"] == "service.name")
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        if span["traceId"] == trace_id:
                            role = next((a["value"]["stringValue"] for a in span.get("attributes", [])
                                         if a["key"] == names.SPAN_ROLE), span["name"])
                            found.setdefault(service, set()).add(role)
    return found


@pytest.fixture(scope="module")
def lab(quick_lab: QuickLab):
    """The session's `kvlab lab --quick` (conftest.quick_lab): its console and run dir."""
    return quick_lab, Path(quick_lab.run_dir)


def test_lab_quick_runs_and_prints_the_comparison(lab):
    result, run_dir = lab
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for text in ("round-robin", "kv-aware", "TTFT p50", "hit rate delivered", "report:"):
        assert text in result.stdout
    assert str(run_dir / "report.html") in result.stdout.replace("\n", "")


# a line a library printed, not kvlab: `[transformers] ...`, `...: FutureWarning: ...`, `WARNING ...`
THIRD_PARTY = re.compile(r"^\s*\[[A-Za-z_][\w.-]*\]|\w*Warning\b|\bWARNING\b|^\s*(?:INFO|DEBUG)\b")


def test_lab_console_carries_no_third_party_warning(lab):
    """A learner reads any warning on the lab's console as an error: what matters is said in
    kvlab's words (`kvlab doctor`), libraries' advice stays out (tests/test_console_quiet.py: torch)."""
    result, _ = lab
    noise = [line for line in (result.stdout + result.stderr).splitlines() if THIRD_PARTY.search(line)]
    assert not noise, noise
    assert THIRD_PARTY.search("[transformers] PyTorch was not found.") and not THIRD_PARTY.search("warning: x")


def test_kv_aware_beats_round_robin_by_the_promised_margins(lab):
    """kv-aware's TTFT p50 is a cache hit only while hits are most of its requests, and each prompt
    group's first request is a miss: a busy machine serves fewer requests in the 25-s phase, so the
    misses weigh more and the p50 climbs towards them. On the dev VM the speedup is 5.5-12.4x; an
    official CI run whose suite took 1,428 s (943 s in a fresh clone before it) served kv-aware 102
    requests instead of 177, delivered 0.67 instead of 0.80 and gave 2.47x. Hence 2x here; the hit
    rate, which a busy machine moves least, keeps its 2x (3.0x in that run)."""
    _, run_dir = lab
    summary = json.loads((run_dir / "summary.json").read_text())
    rr, kv = summary["phases"]["round-robin"], summary["phases"]["kv-aware"]
    assert rr["errors"] == 0 and kv["errors"] == 0
    assert rr["ok"] >= 20 and kv["ok"] >= 20
    assert kv["ttft_ms"]["p50"] <= rr["ttft_ms"]["p50"] / 2
    assert kv["hit_rate"]["delivered"] >= 2 * rr["hit_rate"]["delivered"]
    assert kv["rps"] >= rr["rps"]
    assert summary["comparison"]["ttft_p50_speedup"] == pytest.approx(rr["ttft_ms"]["p50"] / kv["ttft_ms"]["p50"], rel=1e-3)
    # round-robin spreads over every replica; kv-aware did not starve any either
    assert len(rr["replicas"]) == 4 and len(kv["replicas"]) == 4


def test_run_dir_has_the_report_per_phase_files_and_one_trace_per_request(lab):
    _, run_dir = lab
    html = (run_dir / "report.html").read_text()
    assert "Plotly.newPlot" in html and "round-robin" in html and "kv-aware" in html
    for phase in ("phase-1-round-robin", "phase-2-kv-aware"):
        assert (run_dir / phase / "summary.json").exists()
        records = [json.loads(x) for x in (run_dir / phase / "requests.jsonl").read_text().splitlines()]
        assert records and all(r["policy"] == phase.split("-", 2)[2] for r in records)
        assert all(r["available_tokens"] is not None and r["predicted_tokens"] is not None for r in records)
    stack = read_info(run_dir)
    assert stack is not None and stack.status == "stopped"
    assert not any(runs_command(p.pid, p.argv) for p in stack.processes)
    if stack.traces_dir:   # the client's span is the root of a trace that reaches the replica
        record = json.loads((run_dir / "phase-2-kv-aware" / "requests.jsonl").read_text().splitlines()[-1])
        spans = spans_of(Path(stack.traces_dir), record["trace_id"])
        assert "client.request" in spans.get("kvlab-locust", set())
        assert "gateway.request_orchestration" in spans.get("kvlab-gateway", set())
