"""kvlab.traces: readers (OTLP JSON files, Jaeger's OTLP query API), the decision and hit-rate views,
the figures and the `kvlab traces` command, on spans made by the real OTel SDK."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import FakeHandler, http_server
from kvlab.errors import KvlabError
from kvlab.load.measure import Record
from kvlab.stack.base import StackInfo
from kvlab.telemetry import names as n
from kvlab.telemetry.sink import SpanFile
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
    with tracer.start_as_current_span("chat m", kind=trace.SpanKind.SERVER,
                                      attributes={n.SPAN_ROLE: n.SPAN_GATEWAY_REQUEST}) as root:
        root.set_attributes({n.POLICY: policy, n.PROMPT_TOKENS: 128, n.PREFIX_AVAILABLE_TOKENS: 96,
                             n.PREFIX_PREDICTED_TOKENS: predicted, n.PREFIX_DELIVERED_TOKENS: delivered,
                             n.REPLICA: chosen})
        with tracer.start_as_current_span(n.SPAN_SCHEDULE) as s:
            s.set_attributes({n.SCHEDULE_CANDIDATES: json.dumps(CANDIDATES), n.SCHEDULE_CHOSEN: chosen,
                              n.SCHEDULE_WEIGHTS: json.dumps({"prefix": 3.0, "queue": 1.0}),
                              n.SCHEDULE_REASON: "prefix" if policy == "kv-aware" else "round-robin",
                              n.SCHEDULE_SHADOW: policy != "kv-aware", n.POLICY: policy,
                              n.PREFIX_AVAILABLE_TOKENS: 96, n.PREFIX_PREDICTED_TOKENS: predicted})
            s.add_event("picked", {n.REPLICA: chosen})
        with tracer.start_as_current_span("chat m", kind=trace.SpanKind.CLIENT, attributes={n.SPAN_ROLE: n.SPAN_UPSTREAM}):
            with engine.start_as_current_span("chat m", kind=trace.SpanKind.SERVER,
                                              attributes={n.SPAN_ROLE: n.SPAN_ENGINE_REQUEST}) as e:
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
    sink = SpanFile(traces)                 # the sink's own writer: canonical OTLP/JSON lines
    for exporter in (gw_exp, sim_exp):
        sink.write(encode_spans(exporter.get_finished_spans()))
    sink.close()
    with (traces / "traces-1.jsonl").open("w") as fh:
        fh.write('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId"\n')   # cut short by a crash
    for phase, tid, ttft in [("phase-1-round-robin", ids[0], 400.0), ("phase-2-kv-aware", ids[1], 50.0)]:
        (tmp_path / "run" / phase).mkdir()
        (tmp_path / "run" / phase / "requests.jsonl").write_text(json.dumps({"ts": 1.0, "trace_id": tid, "ttft_ms": ttft}) + "\n")
    StackInfo(id="run", run_dir=str(tmp_path / "run"), traces_dir=str(traces)).write()
    return tmp_path / "run"


def test_files_source_groups_processes_into_one_trace(run_dir: Path):
    src = OtlpFileSource(run_dir / "traces")
    traces = src.traces()
    assert len(traces) == 2
    t = traces[1]
    assert t.services == ["kvlab-gateway", "kvlab-sim"]
    assert t.root.role == n.SPAN_GATEWAY_REQUEST and t.root.name == "chat m"
    walk = [(depth, s.role) for depth, s in t.walk()]
    assert walk == [(0, n.SPAN_GATEWAY_REQUEST), (1, n.SPAN_SCHEDULE), (1, n.SPAN_UPSTREAM),
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
    rows = request_hits(traces, [Record(ts=1.0, trace_id=kv.trace_id, ttft_ms=50.0)])
    assert [r.ttft_ms for r in rows] == [None, 50.0]
    stats = summarize(rows)
    assert stats["kv-aware"]["delivered"] == pytest.approx(80 / 128)
    assert stats["round-robin"]["available"] == pytest.approx(96 / 128)
    assert stats["round-robin"]["predicted"] == 0


def test_figures(run_dir: Path, tmp_path: Path):
    traces = OtlpFileSource(run_dir / "traces").traces()
    wf = waterfall_figure(traces[1])
    assert sum(len(bar.y) for bar in wf.data) == 5   # request, schedule, upstream, engine request, prefill
    assert {bar.name for bar in wf.data} == {"kvlab-gateway", "kvlab-sim"}
    d = decision_figure(decision_of(traces[1]))
    totals = d.data[1]
    assert list(totals.x) == [1.0, 3.2, 2.5]
    assert list(totals.marker.color).count("#E45756") == 1 and totals.y[1].startswith("★")
    hr = hitrate_figure(request_hits(traces))
    assert {bar.name for bar in hr.data if bar.type == "bar"} == {"available", "predicted", "delivered"}
    page = write_html([wf, d, hr], tmp_path / "out.html")
    text = page.read_text()
    assert text.count("Plotly.newPlot") == 3 and "plotly.js" in text.lower()


def test_cli_on_a_run(run_dir: Path, capsys, tmp_path: Path):
    assert cli.main(["list", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "kv-aware" in out and "round-robin" in out and "50.0" in out
    assert cli.main(["explain", "--run-dir", str(run_dir), "--html", str(tmp_path / "x.html")]) == 0
    out = capsys.readouterr().out
    for text in ("★ sim-1", "sim-0", "sim-2", "prefix ×3", "available (any replica)    96 (75%)",
                 "predicted (chosen replica) 96 (75%)", "delivered (engine reused)  80 (62%)", "client TTFT                50.0 ms"):
        assert text in out
    assert (tmp_path / "x.html").stat().st_size > 100_000
    tid = OtlpFileSource(run_dir / "traces").traces()[0].trace_id
    assert cli.main(["show", tid[:10], "--run-dir", str(run_dir)]) == 0
    assert n.SPAN_ENGINE_PREFILL in capsys.readouterr().out
    assert cli.main(["show", "ffff", "--run-dir", str(run_dir)]) == 1
    assert cli.main(["list", "--run-dir", str(tmp_path / "nowhere")]) == 1


# ---- Jaeger -----------------------------------------------------------------------------------
# A Jaeger v2 query service as jaeger-idl's api_v3 HTTP binding answers: its OTLP/JSON `result`
# is built from the very lines the sink format wrote for the run (so the parser reads real
# OTLP/JSON), one trace per resource-spans group as Jaeger returns them.


def _resource_spans_by_trace(traces_dir: Path) -> dict[str, list[dict]]:
    """trace id -> resourceSpans holding only that trace's spans, from the run's span files."""
    out: dict[str, list[dict]] = {}
    for line in (line for f in sorted(traces_dir.glob("*.jsonl")) for line in f.read_text().splitlines()):
        try:
            request = json.loads(line)
        except ValueError:
            continue   # the line cut short by a crash
        for rs in request["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    out.setdefault(span["traceId"], []).append(
                        {"resource": rs["resource"], "scopeSpans": [{"scope": ss.get("scope", {}), "spans": [span]}]})
    return out


def _service_of(rs: dict) -> str:
    return next(kv["value"]["stringValue"] for kv in rs["resource"]["attributes"] if kv["key"] == "service.name")


@pytest.fixture
def jaeger_url(run_dir: Path):
    by_trace = _resource_spans_by_trace(run_dir / "traces")
    seen: list[str] = []

    class Handler(FakeHandler):
        def do_GET(self):
            seen.append(self.path)
            url = urllib.parse.urlsplit(self.path)
            q = dict(urllib.parse.parse_qsl(url.query))
            status = 200
            if url.path == "/api/v3/services":
                body = {"services": sorted({_service_of(rs) for groups in by_trace.values() for rs in groups})}
            elif url.path == "/api/v3/traces":
                if not (q.get("query.start_time_min") and q.get("query.start_time_max")):
                    status, body = 400, {"error": {"httpCode": 400, "message": "start_time_min and max are required"}}
                else:
                    found = [rs for groups in by_trace.values()
                             if any(_service_of(rs) == q.get("query.service_name") for rs in groups) for rs in groups]
                    body = {"result": {"resourceSpans": found}}
            elif url.path.startswith("/api/v3/traces/"):
                body = {"result": {"resourceSpans": by_trace.get(url.path.rsplit("/", 1)[1], [])}}
            else:
                status, body = 404, {"error": {"httpCode": 404, "message": "404 page not found"}}
            if status == 200 and "result" in body and not body["result"]["resourceSpans"]:
                status, body = 404, {"error": {"httpCode": 404, "message": "No traces found"}}
            self.reply(status, json.dumps(body).encode())

    with http_server(Handler) as url:
        yield url, seen


def test_jaeger_source_reads_the_same_traces_as_the_files(jaeger_url, run_dir: Path):
    url, seen = jaeger_url
    src = JaegerSource(url)
    files = OtlpFileSource(run_dir / "traces").traces()
    traces = src.traces(limit=5)
    assert [t.trace_id for t in traces] == [t.trace_id for t in files]   # found via both services, once each
    finds = [urllib.parse.parse_qs(urllib.parse.urlsplit(p).query) for p in seen if p.startswith("/api/v3/traces?")]
    assert sorted(q["query.service_name"][0] for q in finds) == ["kvlab-gateway", "kvlab-sim"]
    assert all(q["query.search_depth"] == ["5"] and q["query.start_time_min"][0].endswith("Z") for q in finds)
    for mine, theirs in zip(traces, files):
        assert [(s.span_id, s.parent_id, s.name, s.service, s.kind, s.start_ns, s.end_ns, s.attributes,
                 s.status, s.events) for s in mine] == \
               [(s.span_id, s.parent_id, s.name, s.service, s.kind, s.start_ns, s.end_ns, s.attributes,
                 s.status, s.events) for s in theirs]
    t = src.trace(files[1].trace_id.upper())
    assert t.services == ["kvlab-gateway", "kvlab-sim"] and t.root.role == n.SPAN_GATEWAY_REQUEST
    assert t.first(n.SPAN_SCHEDULE).events[0].name == "picked" and t.root.kind == "server"
    assert [(d, s.role) for d, s in t.walk()][-2:] == [(2, n.SPAN_ENGINE_REQUEST), (3, n.SPAN_ENGINE_PREFILL)]
    d = decision_of(t)
    assert (d.chosen, d.policy, d.shadow, d.available, d.predicted, d.delivered) == ("sim-1", "kv-aware", False, 96, 96, 80)
    assert [c.prefix_tokens for c in d.candidates] == [0, 96, 64]
    assert src.traces(service="nobody") == []               # Jaeger's 404 "No traces found"
    with pytest.raises(KvlabError):
        src.trace("1" * 32)


def test_jaeger_cli(jaeger_url, run_dir: Path, capsys):
    url, _ = jaeger_url
    trace_id = OtlpFileSource(run_dir / "traces").traces()[1].trace_id
    assert cli.main(["explain", trace_id, "--jaeger", url]) == 0
    out = capsys.readouterr().out
    assert "★ sim-1" in out and "delivered (engine reused)  80 (62%)" in out
    assert cli.main(["list", "--jaeger", "http://127.0.0.1:9"]) == 1   # nothing listens: a clear error
