"""kvlab.telemetry.otlp writes the bytes the SDK's own OTLP encoder writes, and its export path
never blocks on a dead collector."""

from __future__ import annotations

import time

import msgspec
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context
from opentelemetry.trace.status import Status, StatusCode

from kvlab.telemetry.otlp import OtlpEncoder
from kvlab.telemetry.packed import pack, unpack
from kvlab.telemetry.setup import build_exporter
from kvlab.telemetry.span_export import _BytesExport

RESOURCE = Resource({"service.name": "kvlab-test", "service.instance.id": "i-1", "host.cores": 2,
                     "lab.tags": ("a", "b")})
REMOTE_PARENT = SpanContext(0x0123456789ABCDEF0123456789ABCDEF, 0x1111, True, TraceFlags(1))


def _spans() -> list[ReadableSpan]:
    """A request's spans as the gateway records them, plus the shapes the encoder leaves to the
    SDK (links, sequences, an int OTLP cannot carry)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    gateway = provider.get_tracer("kvlab.gateway", "1.2")
    for i in range(3):   # recurring values come from the encoder's cache the second time
        with gateway.start_as_current_span("chat kvlab-tiny", kind=SpanKind.SERVER,
                                           context=set_span_in_context(NonRecordingSpan(REMOTE_PARENT))) as request:
            request.set_attributes({"gen_ai.operation.name": "chat", "gen_ai.request.stream": i % 2 == 0,
                                    "kvlab.replica": "sim-1", "kvlab.prompt_tokens": 1867 + i,
                                    "kvlab.tokenize.ms": 0.25 * i, "kvlab.delta": -5, "empty": "",
                                    "zero": 0, "false": False, "text": "é ✓ 日本"})
            with gateway.start_as_current_span("gateway.schedule") as schedule:
                schedule.set_attribute("kvlab.replica", "sim-1")       # the same pair, another span
                schedule.add_event("kvlab.schedule.retry", {"kvlab.replica": "sim-1", "n": i})
                schedule.add_event("")
            with gateway.start_as_current_span("chat kvlab-tiny", kind=SpanKind.CLIENT) as upstream:
                upstream.set_attribute("http.response.status_code", 503)
                upstream.set_status(Status(StatusCode.ERROR, "upstream 503"))
            request.set_status(Status(StatusCode.OK))
    odd = provider.get_tracer("kvlab.other")
    with odd.start_as_current_span("linked", links=[Link(REMOTE_PARENT, {"why": "batch"})]):
        pass
    with odd.start_as_current_span("sequence", attributes={"ids": [1, 2, 3], "names": ("a", "b")}):
        pass
    with odd.start_as_current_span("") as span:
        span.set_attribute("huge", 2 ** 63 + 5)   # msgpack carries it, OTLP int64 cannot
    return list(memory.get_finished_spans())


def _through_the_pipe(spans: list[ReadableSpan]) -> list[list]:
    """Packed as the serving process packs them, decoded as the child decodes them."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode([pack(s) for s in spans]))


def test_the_bytes_are_the_sdks_bytes() -> None:
    spans = _spans()
    limits = SpanLimits()
    encoder = OtlpEncoder(RESOURCE, limits)
    packed = _through_the_pipe(spans)
    for _ in range(2):   # the second pass is served from the cache
        mine = encoder.encode(packed)
        sdk = encode_spans([unpack(p, RESOURCE, limits) for p in packed]).SerializePartialToString()
        assert mine == sdk
    assert ExportTraceServiceRequest.FromString(mine) == encode_spans(spans)


def test_limits_are_the_sdks(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = _through_the_pipe(_spans())   # recorded uncut, as kvlab's recorder records them
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "4")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "1")
    monkeypatch.setenv("OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", "1")
    limits = SpanLimits()
    mine = OtlpEncoder(RESOURCE, limits).encode(packed)
    assert mine == encode_spans([unpack(p, RESOURCE, limits) for p in packed]).SerializePartialToString()
    request = ExportTraceServiceRequest.FromString(mine)
    served = [s for s in request.resource_spans[0].scope_spans[0].spans if s.kind == 2]   # SERVER
    assert len(served) == 3
    assert all(len(s.attributes) == 4 and s.dropped_attributes_count == 6 for s in served)


def test_attribute_length_limit_is_the_sdks(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = _through_the_pipe(_spans())
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "3")
    limits = SpanLimits()
    mine = OtlpEncoder(RESOURCE, limits).encode(packed)
    assert mine == encode_spans([unpack(p, RESOURCE, limits) for p in packed]).SerializePartialToString()
    assert b"\xc3\xa9 \xe2\x9c\x93" in mine and "日本".encode() not in mine


def test_the_child_uses_bytes_for_the_sdks_otlp_http_exporter_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins the private client the bytes path relies on: an SDK upgrade that moves it fails here,
    not silently in every lab."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    assert _BytesExport.accepts(build_exporter("otlp_proto_http"))
    assert not _BytesExport.accepts(build_exporter("console"))


def test_a_dead_collector_drops_batches_and_never_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")  # discard port
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    export = _BytesExport(build_exporter("otlp_proto_http"))
    request = OtlpEncoder(RESOURCE, SpanLimits()).encode(_through_the_pipe(_spans()))
    started = time.monotonic()
    for _ in range(50):
        export.put(request)
    assert time.monotonic() - started < 0.5
    assert export._dropped >= 45
    export.shutdown()
    assert time.monotonic() - started < 10
