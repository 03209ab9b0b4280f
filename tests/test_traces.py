"""kvlab.traces: readers (OTLP JSON files, Jaeger's HTTP API), the decision and hit-rate views,
the figures and the `kvlab traces` command, on spans made by the real OTel SDK."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvlab.errors import KvlabError
from kvlab.telemetry import names as n
from kvlab.telemetry.sink import to_otlp_json
from kvlab.traces import cli
from kvlab.traces.decision import decision_of
from kvlab.traces.figures import decision_figure, hitrate_figure, waterfall_figure, write_html
from kvlab.traces.hitrate import request_hits, summarize
from kvlab.traces.sources.jaeger import JaegerSource
from kvlab.traces.sources.otlp_files import OtlpFileSource

CANDIDATES = [
    {"replica": "sim-0", "scores": {"prefix": 0.0, "queue": 1.0}, "total": 1.0, "prefix_tokens": 0},
    {"replica": "sim-1", "scores": {"prefix": 0.9, "queue": 0.5}, "total": 3.2, "prefix_tokens": 96},
    {"replica": "sim-2", "scores": {"prefix": 0.5, "queue": 1.0}, "total": 2.5, "prefix_tokens": 64},
]


def _provider(service: str, exporter: InMemorySpanExporter) -> TracerProvider:
    p = TracerProvider(resource=Resource.create({"service.name": service}))
    p.add_span_processor(SimpleSpanProcessor(exporter))
    return p


def make_request(gw, sim, policy: str, chosen: str, predicted: int, delivered: int) -> str:
    """One request the way gateway and replica record it; returns its trace id."""
    tracer, engine = gw.get_tracer("kvlab.gateway"), sim.get_tracer("kvlab.engine")
    with tracer.start_as_current_span(n.SPAN_GATEWAY_REQUEST, kind=trace.SpanKind.SERVER) as root:
        root.set_attributes({n.POLICY: policy, n.PROMPT_TOKENS: 128, n.PREFIX_AVAILABLE_TOKENS: 96,
                             n.PREFIX_PREDICTED_TOKENS: predicted, n.PREFIX_DELIVERED_TOKENS: delivered,
                             n.REPLICA: chosen})
        with tracer.start_as_current_span(n.SPAN_TOKENIZE):
            pass
        with tracer.start_as_current_span(n.SPAN_SCHEDULE) as s:
            s.set_attributes({n.SCHEDULE_CANDIDATES: json.dumps(CANDIDATES), n.SCHEDULE_CHOSEN: chosen,
                              n.SCHEDULE_WEIGHTS: json.dumps({"prefix": 3.0, "queue": 1.0}),
                              n.SCHEDULE_REASON: "prefix" if policy == "kv-aware" else "round-robin",
                              n.SCHEDULE_SHADOW: policy != "kv-aware", n.POLICY: policy,
                              n.PREFIX_AVAILABLE_TOKENS: 96, n.PREFIX_PREDICTED_TOKENS: predicted})
        with tracer.start_as_current_span(n.SPAN_UPSTREAM, kind=trace.SpanKind.CLIENT):
            with engine.start_as_current_span(n.SPAN_ENGINE_REQUEST, kind=trace.SpanKind.SERVER) as e:
                e.set_attribute(n.ENGINE_CACHED_TOKENS, delivered)
                with engine.start_as_current_span(n.SPAN_ENGINE_PREFILL):
                    pass
        return format(root.get_span_context().trace_id, "032x")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run folder as the lab leaves it: span files from two processes + requests.jsonl."""
    gw_exp, sim_exp = InMemorySpanExporter(), InMemorySpanExporter()
    gw, sim = _provider("kvlab-gateway", gw_exp), _provider("kvlab-sim", sim_exp)
    ids = [make_request(gw, sim, "round-robin", "sim-0", 0, 0),
           make_request(gw, sim, "kv-aware", "sim-1", 96, 80)]
    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    with (traces / "traces-1.jsonl").open("w") as fh:
        for exporter in (gw_exp, sim_exp):
            fh.write(json.dumps(to_otlp_json(encode_spans(exporter.get_finished_spans()))) + "\n")
        fh.write('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId"\n')   # cut short by a crash
    for phase, tid, ttft in [("phase-1-round-robin", ids[0], 400.0), ("phase-2-kv-aware", ids[1], 50.0)]:
        (tmp_path / "run" / phase).mkdir()
        (tmp_path / "run" / phase / "requests.jsonl").write_text(json.dumps({"trace_id": tid, "ttft_ms": ttft}) + "\n")
    (tmp_path / "run" / "stack.json").write_text(json.dumps({"traces_dir": str(traces)}))
    return tmp_path / "run"


def test_files_source_groups_processes_into_one_trace(run_dir: Path):
    src = OtlpFileSource(run_dir / "traces")
    traces = src.traces()
    assert len(traces) == 2
    t = traces[1]
    assert t.services == ["kvlab-gateway", "kvlab-sim"]
    assert t.root.name == n.SPAN_GATEWAY_REQUEST
    walk = [(depth, s.name) for depth, s in t.walk()]
    assert walk == [(0, n.SPAN_GATEWAY_REQUEST), (1, n.SPAN_TOKENIZE), (1, n.SPAN_SCHEDULE), (1, n.SPAN_UPSTREAM),
                    (2, n.SPAN_ENGINE_REQUEST), (3, n.SPAN_ENGINE_PREFILL)]
    assert src.trace(t.trace_id.upper()) is t
    assert src.traces(limit=1) == [t]
    with pytest.raises(KvlabError):
        src.trace("0" * 32)


def test_decision_and_hit_rates(run_dir: Path):
    traces = OtlpFileSource(run_dir / "traces").traces()
    rr, kv = (decision_of(t) for t in traces)
    assert rr.shadow and rr.chosen == "sim-0" and rr.policy == "round-robin"
    assert kv.chosen == "sim-1" and not kv.shadow and kv.reason == "prefix"
    assert [c.replica for c in kv.candidates if c.chosen] == ["sim-1"]
    assert kv.scorers == ["prefix", "queue"] and kv.weights == {"prefix": 3.0, "queue": 1.0}
    assert (kv.prompt_tokens, kv.available, kv.predicted, kv.delivered) == (128, 96, 96, 80)
    rows = request_hits(traces, [{"trace_id": kv.trace_id, "ttft_ms": 50.0}])
    assert [r.ttft_ms for r in rows] == [None, 50.0]
    stats = summarize(rows)
    assert stats["kv-aware"]["delivered"] == pytest.approx(80 / 128)
    assert stats["round-robin"]["available"] == pytest.approx(96 / 128)
    assert stats["round-robin"]["predicted"] == 0


def test_figures(run_dir: Path, tmp_path: Path):
    traces = OtlpFileSource(run_dir / "traces").traces()
    wf = waterfall_figure(traces[1])
    assert sum(len(bar.y) for bar in wf.data) == 6
    assert {bar.name for bar in wf.data} == {"kvlab-gateway", "kvlab-sim"}
    d = decision_figure(decision_of(traces[1]))
    totals = d.data[1]
    assert list(totals.x) == [1.0, 3.2, 2.5]
    assert [c for c in totals.marker.color].count("#E45756") == 1 and totals.y[1].startswith("★")
    hr = hitrate_figure(request_hits(traces))
    assert {bar.name for bar in hr.data if bar.type == "bar"} == {"available", "predicted", "delivered"}
    page = write_html([wf, d, hr], tmp_path / "out.html")
    text = page.read_text()
    assert text.count("Plotly.newPlot") == 3 and "plotly.js" in text.lower()


def test_cli_on_a_run(run_dir: Path, capsys, tmp_path: Path):
    assert cli.main(["list", "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "kv-aware" in out and "round-robin" in out and "50.0" in out
    assert cli.main(["explain", "--run", str(run_dir), "--html", str(tmp_path / "x.html")]) == 0
    out = capsys.readouterr().out
    for text in ("★ sim-1", "sim-0", "sim-2", "prefix ×3", "available (any replica)    96 (75%)",
                 "predicted (chosen replica) 96 (75%)", "delivered (engine reused)  80 (62%)", "client TTFT                50.0 ms"):
        assert text in out
    assert (tmp_path / "x.html").stat().st_size > 100_000
    tid = OtlpFileSource(run_dir / "traces").traces()[0].trace_id
    assert cli.main(["show", tid[:10], "--run", str(run_dir)]) == 0
    assert n.SPAN_ENGINE_PREFILL in capsys.readouterr().out
    assert cli.main(["show", "ffff", "--run", str(run_dir)]) == 1
    assert cli.main(["list", "--run", str(tmp_path / "nowhere")]) == 1


# ---- Jaeger -----------------------------------------------------------------------------------
# A response in the shape of Jaeger v2's /api/traces (model/json): microsecond times, typed tags,
# CHILD_OF references, services in `processes`.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
JAEGER_TRACE = {
    "traceID": TRACE_ID,
    "spans": [
        {"traceID": TRACE_ID, "spanID": "00f067aa0ba902b7", "operationName": n.SPAN_GATEWAY_REQUEST,
         "references": [], "startTime": 1700000000000000, "duration": 5000, "processID": "p1", "logs": [],
         "tags": [{"key": "span.kind", "type": "string", "value": "server"},
                  {"key": n.POLICY, "type": "string", "value": "kv-aware"},
                  {"key": n.PROMPT_TOKENS, "type": "int64", "value": 128},
                  {"key": n.PREFIX_DELIVERED_TOKENS, "type": "int64", "value": 64},
                  {"key": "otel.status_code", "type": "string", "value": "OK"}]},
        {"traceID": TRACE_ID, "spanID": "00f067aa0ba902b8", "operationName": n.SPAN_SCHEDULE,
         "references": [{"refType": "CHILD_OF", "traceID": TRACE_ID, "spanID": "00f067aa0ba902b7"}],
         "startTime": 1700000000000100, "duration": 300, "processID": "p1",
         "logs": [{"timestamp": 1700000000000200, "fields": [{"key": "event", "type": "string", "value": "picked"}]}],
         "tags": [{"key": n.SCHEDULE_CANDIDATES, "type": "string", "value": json.dumps(CANDIDATES)},
                  {"key": n.SCHEDULE_CHOSEN, "type": "string", "value": "sim-1"},
                  {"key": n.SCHEDULE_SHADOW, "type": "bool", "value": False},
                  {"key": n.PREFIX_AVAILABLE_TOKENS, "type": "int64", "value": 96},
                  {"key": n.PREFIX_PREDICTED_TOKENS, "type": "int64", "value": 96},
                  {"key": "kvlab.engine.queue_ms", "type": "float64", "value": 1.5}]},
        {"traceID": TRACE_ID, "spanID": "00f067aa0ba902b9", "operationName": n.SPAN_ENGINE_REQUEST,
         "references": [{"refType": "CHILD_OF", "traceID": TRACE_ID, "spanID": "00f067aa0ba902b7"}],
         "startTime": 1700000000000500, "duration": 4000, "processID": "p2", "logs": [],
         "tags": [{"key": "span.kind", "type": "string", "value": "server"},
                  {"key": "error", "type": "bool", "value": True}]},
    ],
    "processes": {"p1": {"serviceName": "kvlab-gateway", "tags": []},
                  "p2": {"serviceName": "kvlab-sim", "tags": []}},
    "warnings": None,
}


@pytest.fixture
def jaeger_url():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            if self.path == "/api/services":
                body = {"data": ["kvlab-gateway", "kvlab-sim"], "total": 2}
            elif self.path.startswith("/api/traces?"):
                body = {"data": [JAEGER_TRACE], "total": 0, "limit": 0, "offset": 0, "errors": None}
            elif self.path == f"/api/traces/{TRACE_ID}":
                body = {"data": [JAEGER_TRACE], "errors": None}
            else:
                self.send_response(404)
                self.end_headers()
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_jaeger_source(jaeger_url):
    url, seen = jaeger_url
    src = JaegerSource(url)
    traces = src.traces(limit=5)
    assert len(traces) == 1                       # the same trace found via both services, once
    assert any(p.startswith("/api/traces?") and "service=kvlab-sim" in p and "limit=5" in p for p in seen)
    t = src.trace(TRACE_ID)
    assert t.services == ["kvlab-gateway", "kvlab-sim"]
    root = t.root
    assert (root.name, root.kind, root.status, root.duration_ms) == (n.SPAN_GATEWAY_REQUEST, "server", "ok", 5.0)
    engine = t.first(n.SPAN_ENGINE_REQUEST)
    assert engine.parent_id == root.span_id and engine.status == "error" and "error" not in engine.attributes
    schedule = t.first(n.SPAN_SCHEDULE)
    assert schedule.events[0].name == "picked" and schedule.attributes["kvlab.engine.queue_ms"] == 1.5
    d = decision_of(t)
    assert (d.chosen, d.policy, d.shadow, d.available, d.predicted, d.delivered) == ("sim-1", "kv-aware", False, 96, 96, 64)
    assert [c.prefix_tokens for c in d.candidates] == [0, 96, 64]
    with pytest.raises(KvlabError):
        src.trace("1" * 32)


def test_jaeger_cli(jaeger_url, capsys):
    url, _ = jaeger_url
    assert cli.main(["explain", TRACE_ID, "--jaeger", url]) == 0
    out = capsys.readouterr().out
    assert "★ sim-1" in out and "delivered (engine reused)  64 (50%)" in out
    assert cli.main(["list", "--jaeger", "http://127.0.0.1:9"]) == 1   # nothing listens: a clear error
