"""The OTLP/HTTP sink (a real subprocess fed by the real OTel exporter) and the choice of trace
target the local stack makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvlab.stack.local import start_trace_backend
from kvlab.telemetry.sink import choose_trace_target
from kvlab.traces.sources.otlp_files import OtlpFileSource

pytestmark = pytest.mark.processes   # starts servers: not in `make test-fast`

EXPORT = r"""
import json, sys
from opentelemetry import trace
from kvlab.telemetry.setup import configure_tracing, shutdown_tracing

configure_tracing("probe")
tracer = trace.get_tracer("probe")
ids = []
with tracer.start_as_current_span("root", kind=trace.SpanKind.SERVER) as root:
    root.set_attribute("kvlab.schedule.candidates", json.dumps([{"replica": "sim-0", "total": 1.5}]))
    root.set_attribute("kvlab.prompt_tokens", 42)
    root.set_attribute("kvlab.schedule.shadow", True)
    root.set_attribute("kvlab.moe.tokens_per_ep_rank", [3, 4])
    root.add_event("picked", {"kvlab.replica": "sim-0"})
    with tracer.start_as_current_span("child") as child:
        ids = [format(root.get_span_context().trace_id, "032x"), format(root.get_span_context().span_id, "016x"),
               format(child.get_span_context().span_id, "016x")]
shutdown_tracing()
print(json.dumps(ids))
"""


def _post(url: str, body: bytes, ctype: str) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": ctype}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def sink(tmp_path: Path):
    ready = tmp_path / "ready.json"
    out = tmp_path / "traces"
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.telemetry.sink", "--port", "0", "--out", str(out),
                             "--ready-file", str(ready)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ready.is_file():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "sink not ready"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        yield info["otlp_endpoint"], out, proc
    finally:
        proc.terminate()
        proc.wait(10)


def _export(endpoint: str, compression: str) -> list[str]:
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_COMPRESSION": compression}
    out = subprocess.run([sys.executable, "-c", EXPORT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_sink_stores_what_the_otel_exporter_sends(sink, compression):
    endpoint, out, _ = sink
    trace_id, root_id, child_id = _export(endpoint, compression)
    spans = {s.name: s for t in OtlpFileSource(out).traces() for s in t}
    root, child = spans["root"], spans["child"]
    assert (root.trace_id, root.span_id, root.parent_id) == (trace_id, root_id, None)
    assert (child.trace_id, child.parent_id, child.span_id) == (trace_id, root_id, child_id)
    assert root.service == "probe" and root.kind == "server" and child.kind == "internal"
    assert root.attributes["kvlab.prompt_tokens"] == 42
    assert root.attributes["kvlab.schedule.shadow"] is True
    assert root.attributes["kvlab.moe.tokens_per_ep_rank"] == [3, 4]
    assert root.json_attr("kvlab.schedule.candidates") == [{"replica": "sim-0", "total": 1.5}]
    assert root.events[0].name == "picked" and root.events[0].attributes == {"kvlab.replica": "sim-0"}
    # the stored line is OTLP/JSON: hex ids, integer enums
    line = json.loads(next(out.glob("*.jsonl")).read_text().splitlines()[0])
    raw = line["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert {s["traceId"] for s in raw} == {trace_id}
    assert all(isinstance(s["kind"], int) for s in raw)


def test_sink_accepts_otlp_json_and_rejects_garbage_without_dying(sink):
    endpoint, out, proc = sink
    good = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "j"}}]},
                               "scopeSpans": [{"spans": [{"traceId": "5b8efff798038103d269b633813fc60c",
                                                          "spanId": "eee19b7ec3c1b174", "name": "from-json", "kind": 3,
                                                          "startTimeUnixNano": "1000", "endTimeUnixNano": "3000",
                                                          "unknownFutureField": 1}]}]}]}
    status, body = _post(f"{endpoint}/v1/traces", json.dumps(good).encode(), "application/json")
    assert status == 200 and json.loads(body) == {}
    for payload, ctype in [(b"not json", "application/json"), (b"[1, 2]", "application/json"),
                           (b'{"resourceSpans": 5}', "application/json"),
                           (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}).encode(),
                            "application/json"),
                           (b"\xff\xfe garbage", "application/x-protobuf")]:
        status, body = _post(f"{endpoint}/v1/traces", payload, ctype)
        assert status == 400, payload
        assert "message" in json.loads(body)
    assert _post(f"{endpoint}/v1/metrics", b"", "application/x-protobuf")[0] == 200
    assert _post(f"{endpoint}/v1/logs", b"{}", "application/json")[0] == 200
    assert proc.poll() is None
    (span,) = [s for t in OtlpFileSource(out).traces() for s in t]
    assert (span.name, span.kind, span.service, span.duration_ms) == ("from-json", "client", "j", 0.002)


def test_choose_trace_target(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))   # no jaeger on PATH
    assert choose_trace_target("off", tmp_path).otlp_endpoint is None
    ext = choose_trace_target("http://collector:4318/", tmp_path)
    assert (ext.kind, ext.otlp_endpoint, ext.argv) == ("endpoint", "http://collector:4318", None)
    for setting in ("auto", "files"):
        files = choose_trace_target(setting, tmp_path)
        assert files.kind == "files" and files.traces_dir == tmp_path / "traces"
        assert files.argv[1:3] == ["-m", "kvlab.telemetry.sink"]
    with pytest.raises(ValueError):
        choose_trace_target("jaeger", tmp_path)
    with pytest.raises(ValueError):
        choose_trace_target("zipkin", tmp_path)
    fake = tmp_path / "bin" / "jaeger"
    jaeger = choose_trace_target("auto", tmp_path, jaeger_binary=str(fake))
    assert jaeger.kind == "jaeger" and jaeger.argv == [str(fake), "--config", str(tmp_path / "jaeger.yaml")]
    config = yaml.safe_load(jaeger.config_text)
    otlp_http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    query_http = config["extensions"]["jaeger_query"]["http"]["endpoint"]
    assert jaeger.otlp_endpoint == f"http://{otlp_http}" and jaeger.query_url == f"http://{query_http}"
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["jaeger_storage_exporter"]
    # "files" never starts Jaeger even when one is installed
    assert choose_trace_target("files", tmp_path, jaeger_binary=str(fake)).kind == "files"


def test_start_trace_backend_runs_the_sink_until_stopped(tmp_path: Path):
    target = choose_trace_target("files", tmp_path)
    proc = start_trace_backend(target, tmp_path / "logs" / "sink.log").popen
    try:
        with urllib.request.urlopen(target.ready_url, timeout=5) as resp:
            assert json.load(resp)["status"] == "ok"
        assert target.traces_dir.is_dir()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
