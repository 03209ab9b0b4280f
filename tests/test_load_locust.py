"""Locust users against a real simulator replica: streaming measured, records and Locust CSVs written."""

from __future__ import annotations

import csv
import json
import time

import msgspec
import pytest
import requests

from conftest import FakeHandler, http_server, sim_process
from kvlab.load.measure import Record, chat_body, stream_chat
from kvlab.load.runner import run_bench
from kvlab.load.spec import BenchSpec
from kvlab.load.workloads import create
from kvlab.telemetry.sink import parse_traces, to_otlp_json

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    with sim_process(tmp_path_factory.mktemp("sim"), "--replicas", "1", "--time-scale", "0.2") as (_, info):
        yield info["replicas"][0]


def test_stream_chat_measures_ttft_itl_and_cached_tokens(replica):
    req = create("shared-prefix", seed=0, params={"groups": 1, "system_tokens": 600, "output_tokens": 12}).requests(1)[0]
    with requests.Session() as s:
        first = stream_chat(s, f"{replica['url']}/v1/chat/completions", chat_body(req, "kvlab-tiny", 0), {},
                            Record(ts=time.time()))
        again = stream_chat(s, f"{replica['url']}/v1/chat/completions", chat_body(req, "kvlab-tiny", 1), {},
                            Record(ts=time.time()))
        bad = stream_chat(s, f"{replica['url']}/v1/chat/completions", {"model": "nope", "messages": []}, {},
                          Record(ts=time.time()))
    assert first.error is None and first.status == 200
    assert first.output_tokens == 12 and first.prompt_tokens > 600
    assert 0 < first.ttft_ms < first.e2e_ms and first.itl_ms > 0 and first.tpot_ms > 0
    assert first.replica == replica["name"]
    assert first.cached_tokens == 0 and again.cached_tokens >= 0.9 * first.prompt_tokens // 16 * 16
    assert again.ttft_ms < first.ttft_ms
    assert bad.error and bad.status in (400, 404) and bad.ttft_ms is None


def test_bench_writes_records_summary_and_locust_csv(replica, tmp_path):
    seen = []
    spec = BenchSpec(workload="shared-prefix", params={"groups": 2, "system_tokens": 300, "output_tokens": 8},
                     users=3, duration_s=4, seed=5, min_requests=5)   # a loaded machine starts Locust slowly
    summary = run_bench(replica["url"], tmp_path, spec, phase="direct",
                        progress=lambda elapsed, records: seen.append(len(records)))
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == summary.requests >= 5 and summary.errors == 0
    assert max(seen) == len(records)
    for r in records:
        assert r["phase"] == "direct" and r["workload"] == "shared-prefix"
        assert r["ttft_ms"] > 0 and r["output_tokens"] == 8 and r["replica"] == replica["name"]
        assert len(r["trace_id"]) == 32
    assert summary.hit_rate.delivered > 0.3       # 2 groups on one replica: mostly hits
    assert summary.hit_rate.available is None      # no gateway, no routing headers
    assert json.loads((tmp_path / "summary.json").read_text())["ttft_ms"] == msgspec.to_builtins(summary.ttft_ms)
    # locust_stats.csv is a periodic snapshot (it can lag the end of the run); the final counts are
    # the summary table Locust prints on exit, in locust.log
    with open(tmp_path / "locust_stats.csv") as f:
        assert {"Type", "Name", "Request Count"} <= set(csv.DictReader(f).fieldnames or ())
    # the request-count table comes first; the percentiles table after it has the same row names and
    # the p50 latency in the same column, so only a name's first row counts
    final: dict[tuple[str, ...], int] = {}
    for line in (tmp_path / "locust.log").read_text().splitlines():
        if line.split()[:2] in (["POST", "chat"], ["TTFT", "chat"], ["ITL", "chat"]):
            final.setdefault(tuple(line.split()[:2]), int(line.split()[2]))
    # every request Locust counted is in requests.jsonl; requests that finish while Locust stops are
    # recorded but not counted by Locust (issue-20 follow-up: why that gap grew on main)
    assert 0 < final[("POST", "chat")] <= len(records)
    assert ("TTFT", "chat") in final and ("ITL", "chat") in final
    report = (tmp_path / "locust.html").read_text()   # Locust's own HTML report, per phase
    assert "<html" in report.lower() and "chat" in report and "TTFT" in report


def test_the_client_samples_what_the_topology_says(replica, tmp_path):
    """The load generator roots every trace, so `observability.sample_ratio` (BenchSpec's
    `trace_sample_ratio`) must reach it; by default (kvlab's sampler) every trace at this rate is kept."""
    spans: list[int] = []

    class Receiver(FakeHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            otlp = to_otlp_json(parse_traces(body, self.headers.get("Content-Type", "")))
            spans.append(sum(len(ss["spans"]) for rs in otlp["resourceSpans"] for ss in rs["scopeSpans"]))
            self.reply(200, b"", "application/x-protobuf")

    spec = BenchSpec(workload="shared-prefix", params={"groups": 1, "system_tokens": 100, "output_tokens": 2},
                     users=2, duration_s=2, seed=1, min_requests=3)
    with http_server(Receiver) as url:
        default = run_bench(replica["url"], tmp_path / "default", spec, otlp_endpoint=url)
        kept = sum(spans)
        spans.clear()
        none = run_bench(replica["url"], tmp_path / "none", msgspec.structs.replace(spec, trace_sample_ratio=0.0),
                         otlp_endpoint=url)
    assert default.ok >= 3 and none.ok >= 3
    assert kept >= default.requests     # at least the client span of every request
    assert sum(spans) == 0
