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
