"""A lab phase runs until its duration *and* a minimum of completed requests, within a hard limit
that fails naming the slow part (kvlab.load.runner.run_bench, `kvlab lab --min-requests`)."""

from __future__ import annotations

import json
import signal

import pytest

from conftest import sim_process
from kvlab.errors import StackError
from kvlab.load.measure import Record
from kvlab.load.runner import run_bench, slow_part
from kvlab.load.spec import BenchSpec

pytestmark = pytest.mark.slow
COLD = {"groups": 64, "system_tokens": 1500, "output_tokens": 4}   # nearly every request a cold prefill


def test_phase_runs_past_its_duration_until_the_minimum(tmp_path):
    # cpu-tiny: a cold 1,500-token prefill takes ~1 s, so one user completes ~2 requests in 2 s
    with sim_process(tmp_path, "--no-kv-events") as (_, info):
        summary = run_bench(info["replicas"][0]["url"], tmp_path / "phase",
                            BenchSpec(params=COLD, users=1, duration_s=2, min_requests=5, limit_s=60), phase="p")
    assert summary.ok >= 5 and summary.duration_s > 3.0
    assert (summary.min_requests, summary.limit_s) == (5, 60)
    assert json.loads((tmp_path / "phase" / "summary.json").read_text())["ok"] == summary.ok
    # stopped early by kvlab, Locust still wrote its own HTML report (SIGINT, not SIGTERM)
    assert "locust" in (tmp_path / "phase" / "locust.html").read_text().lower()


def test_a_phase_stops_on_time_when_kvlab_runs_in_the_background(tmp_path):
    """A background job (`kvlab lab &`, nohup) has SIGINT ignored, and its children inherit that:
    Locust must still stop on kvlab's SIGINT, not send for the 15-s grace period (it did: a 25-s
    quick lab phase took 41 s and counted 130 requests, not ~80)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sim_process(tmp_path, "--no-kv-events") as (_, info):
            summary = run_bench(info["replicas"][0]["url"], tmp_path / "phase",
                                BenchSpec(params=COLD, users=1, duration_s=2, min_requests=1, limit_s=60), phase="bg")
    finally:
        signal.signal(signal.SIGINT, previous)
    # sent for ~2 s, the last cold request (~1 s) finishing after: never the grace period's 15 s
    assert summary.ok >= 1 and summary.duration_s < 8, summary.duration_s


def test_phase_that_cannot_reach_its_minimum_fails_naming_the_slow_part(tmp_path):
    # 30x slower: a prefill takes ~30 s, nothing completes within the 6-s limit
    with sim_process(tmp_path, "--no-kv-events", "--time-scale", "30") as (_, info):
        with pytest.raises(StackError, match=r"completed 0 of the 3 requests .* 6-s limit: no request finished"):
            run_bench(info["replicas"][0]["url"], tmp_path / "phase",
                      BenchSpec(params=COLD, users=2, duration_s=2, min_requests=3, limit_s=6), phase="slow")
    written = json.loads((tmp_path / "phase" / "summary.json").read_text())
    assert written["ok"] == 0 and written["min_requests"] == 3


def test_slow_part_names_prefill_or_generation():
    prefill = [Record(ts=0.0, ttft_ms=9000.0, e2e_ms=9500.0)]
    decode = [Record(ts=0.0, ttft_ms=300.0, e2e_ms=60000.0)]
    assert "prefill" in slow_part(prefill, 100) and "TTFT p50 9.0 s" in slow_part(prefill, 100)
    assert "generation" in slow_part(decode, 100)
    assert slow_part([Record(ts=0.0, error="HTTP 500")], 100) == "every request failed (HTTP 500)"
