"""kvlab's OTLP/HTTP JSON exporter: the JSON mapping, and failing soft."""

from __future__ import annotations

import json
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from conftest import free_port
from kvlab.telemetry.otlp_json import OtlpJsonSpanExporter, encode


def _spans():
    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({"service.name": "unit"}))
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("kvlab.test", "1.0")
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER) as root:
        root.set_attributes({"i": 7, "f": 0.5, "b": True, "s": "x", "a": [1, 2]})
        root.add_event("picked", {"replica": "sim-0"})
        with tracer.start_as_current_span("child", kind=SpanKind.CLIENT) as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
    return mem.get_finished_spans(), root, child


def test_json_mapping_of_ids_kinds_attributes_events_and_status():
    spans, root, child = _spans()
    doc = json.loads(encode(spans))
    rs = doc["resourceSpans"]
    assert len(rs) == 1
    assert {"key": "service.name", "value": {"stringValue": "unit"}} in rs[0]["resource"]["attributes"]
    scope = rs[0]["scopeSpans"][0]
    assert scope["scope"] == {"name": "kvlab.test", "version": "1.0"}
    by = {s["name"]: s for s in scope["spans"]}
    r, c = by["root"], by["child"]
    assert r["traceId"] == format(root.get_span_context().trace_id, "032x") == c["traceId"]
    assert c["parentSpanId"] == r["spanId"] == format(root.get_span_context().span_id, "016x")
    assert "parentSpanId" not in r
    assert (r["kind"], c["kind"]) == (2, 3)                     # OTLP: SERVER 2, CLIENT 3
    attrs = {a["key"]: a["value"] for a in r["attributes"]}
    assert attrs == {"i": {"intValue": "7"}, "f": {"doubleValue": 0.5}, "b": {"boolValue": True},
                     "s": {"stringValue": "x"},
                     "a": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "2"}]}}}
    assert r["events"][0]["name"] == "picked"
    assert c["status"] == {"code": 2, "message": "boom"}
    assert int(r["endTimeUnixNano"]) >= int(c["endTimeUnixNano"]) > int(r["startTimeUnixNano"])


def test_a_dead_backend_fails_soft_and_fast():
    spans, _, _ = _spans()
    exporter = OtlpJsonSpanExporter(f"http://127.0.0.1:{free_port()}/v1/traces", timeout_s=2)
    start = time.monotonic()
    assert exporter.export(spans) is SpanExportResult.FAILURE     # no exception for the caller
    assert exporter.export(spans) is SpanExportResult.FAILURE
    assert time.monotonic() - start < 5
    exporter.shutdown()
