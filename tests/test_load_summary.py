"""summary.json computation, the JSONL tail reader and the before/after table."""

from __future__ import annotations

import json

from rich.console import Console

from kvlab.load.measure import Record
from kvlab.load.runner import JsonlTail
from kvlab.load.summary import HitRate, summarize
from kvlab.load.table import summary_table


def rec(i, ttft, cached, error=None, replica="sim-0", prompt=1000, available=None, predicted=None):
    return Record(ts=100.0 + i * 0.5, ttft_ms=ttft, itl_ms=10.0, tpot_ms=11.0, e2e_ms=400.0,
                  prompt_tokens=prompt, output_tokens=32, cached_tokens=cached, available_tokens=available,
                  predicted_tokens=predicted, replica=replica, error=error)


def test_percentiles_rates_and_hit_rates():
    records = [rec(i, ttft=float(i + 1), cached=500, available=900, predicted=600,
                   replica=f"sim-{i % 2}") for i in range(100)]
    records.append(rec(100, ttft=None, cached=None, error="HTTP 503: down"))
    s = summarize(records)
    assert s.requests == 101 and s.ok == 100 and s.errors == 1
    assert s.first_error == "HTTP 503: down"
    assert abs(s.ttft_ms.p50 - 50.5) < 1e-6
    assert 94 < s.ttft_ms.p95 < 97 and 98 < s.ttft_ms.p99 <= 100
    assert s.hit_rate == HitRate(available=0.9, predicted=0.6, speculative=None, delivered=0.5)
    # window: first send (t=100) to last end (t=150 + 0.4)
    assert abs(s.duration_s - 50.4) < 1e-6
    assert abs(s.rps - 100 / 50.4) < 1e-3
    assert abs(s.output_tok_s - 3200 / 50.4) < 1e-2
    assert s.replicas == {"sim-0": 50, "sim-1": 50}


def test_hit_rates_absent_without_gateway_headers():
    s = summarize([rec(0, 5.0, cached=0)])
    assert s.hit_rate.available is None and s.hit_rate.delivered == 0.0
    assert summarize([]).requests == 0


def test_jsonl_tail_reads_only_complete_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    tail = JsonlTail(path)
    assert tail.poll() == []
    with open(path, "w") as f:
        f.write(json.dumps({"ts": 1}) + "\n" + '{"ts": ')
    assert tail.poll() == [Record(ts=1)]
    with open(path, "a") as f:
        f.write('2}\n')
    assert tail.poll() == [Record(ts=1), Record(ts=2)]


def test_table_shows_the_change_in_the_right_direction():
    before = summarize([rec(i, ttft=600.0, cached=0) for i in range(10)])
    after = summarize([rec(i, ttft=60.0, cached=900) for i in range(10)])
    console = Console(width=120, record=True)
    console.print(summary_table({"round-robin": before, "kv-aware": after}))
    text = console.export_text()
    assert "10.0× lower" in text
    line = next(ln for ln in text.splitlines() if "hit rate delivered" in ln)
    assert "0%" in line and "90%" in line and "new" in line


def test_a_closed_loop_table_has_no_open_loop_rows_and_small_changes_read_as_such():
    from kvlab.load.summary import Goodput, Slo

    before = summarize([rec(i, ttft=600.0, cached=0) for i in range(10)])
    after = summarize([rec(i, ttft=610.0 if i < 9 else 400.0, cached=0) for i in range(10)])
    slo = Slo(ttft_ms=1500, tpot_ms=150)
    before.goodput, after.goodput = Goodput(slo=slo, met=5, rps=1.0), Goodput(slo=slo, met=8, rps=1.5)
    console = Console(width=160, record=True)
    console.print(summary_table({"a": before, "b": after}))
    text = console.export_text()
    assert "offered" not in text and "sends late" not in text and "unfinished" not in text
    assert "goodput: requests with TTFT ≤ 1500 ms and TPOT ≤ 150 ms" in text   # the caption names the SLO
    row = {ln.split("│")[1].strip(): ln for ln in text.splitlines() if ln.count("│") >= 4}
    assert row["TTFT p50 (ms)"].rstrip(" │").endswith("≈")              # 600 → 610: within 3 %
    assert "50% higher" in row["goodput (req/s, SLO met)"] and row["errors"].rstrip(" │").endswith("=")
    assert "1.0×" not in text


def test_the_doctor_line_names_a_dtype_only_for_vllm():
    from kvlab.doctor import diagnose, one_line

    report = diagnose()
    assert "dtype" not in one_line(report, "sim") and "sim engine" in one_line(report, "sim")
    assert ("dtype" in one_line(report, "vllm")) == report.parts["vllm"].installed
