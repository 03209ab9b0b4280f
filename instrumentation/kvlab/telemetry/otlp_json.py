"""A fast OTLP/HTTP **JSON** span exporter (`OTEL_EXPORTER_OTLP_PROTOCOL=http/json`).

The SDK's protobuf exporter spends ~50 µs of Python per span building protobuf messages; at the
gateway's saturation rate (~2,000 requests/s, 4 spans each) that is most of a core, taken from the
event loop through the GIL. OTLP/HTTP also accepts JSON (the OTLP spec's JSON mapping: hex ids,
enum numbers, 64-bit integers as strings), and encoding plain dicts with msgspec costs a few µs per
span. Jaeger v2, the OpenTelemetry Collector and kvlab's own sink all accept it.

Like every OTel exporter it fails soft: a dead or slow backend costs dropped spans and one log line
per failure streak, never an exception in the caller.
"""

from __future__ import annotations

import http.client
import logging
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, str):
        return {"stringValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _attributes(attrs: Any) -> list[dict[str, Any]]:
    # the SDK hands out a read-only proxy of a locked mapping whose generic items() costs ~10 µs;
    # its plain dict, when there, is read directly
    plain = getattr(attrs, "_dict", None) if attrs is not None else None
    return [{"key": k, "value": _value(v)} for k, v in (plain if plain is not None else (attrs or {})).items()]


def _span(s: ReadableSpan) -> dict[str, Any]:
    ctx = s.get_span_context()
    out: dict[str, Any] = {
        "traceId": format(ctx.trace_id, "032x"),
        "spanId": format(ctx.span_id, "016x"),
        "name": s.name,
        "kind": s.kind.value + 1,          # OTLP: 0 unspecified, 1 internal, 2 server, 3 client, ...
        "startTimeUnixNano": str(s.start_time),
        "endTimeUnixNano": str(s.end_time),
        "attributes": _attributes(getattr(s, "_attributes", None) or s.attributes),
        "status": {"code": s.status.status_code.value},
    }
    if s.parent is not None:
        out["parentSpanId"] = format(s.parent.span_id, "016x")
    if s.status.description:
        out["status"]["message"] = s.status.description
    if s.events:
        out["events"] = [{"timeUnixNano": str(e.timestamp), "name": e.name, "attributes": _attributes(e.attributes)}
                         for e in s.events]
    if s.links:
        out["links"] = [{"traceId": format(link.context.trace_id, "032x"), "spanId": format(link.context.span_id, "016x"),
                         "attributes": _attributes(link.attributes)} for link in s.links]
    return out


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest in OTLP's JSON mapping, spans grouped by resource and scope."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for s in spans:
        res, scopes = by_resource.setdefault(id(s.resource), (s.resource, {}))
        scope = s.instrumentation_scope
        key = (scope.name, scope.version or "") if scope is not None else ("", "")
        scopes.setdefault(key, []).append(_span(s))
    return _encode({"resourceSpans": [
        {"resource": {"attributes": _attributes(res.attributes if res is not None else {})},
         "scopeSpans": [{"scope": {"name": name, "version": version}, "spans": group}
                        for (name, version), group in scopes.items()]}
        for res, scopes in by_resource.values()]})


def traces_endpoint() -> str | None:
    """The traces URL from the standard variables (`..._TRACES_ENDPOINT` as is, else base + /v1/traces)."""
    url = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if url:
        return url
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


class OtlpJsonSpanExporter(SpanExporter):
    """POSTs OTLP/JSON to `endpoint` over one keep-alive HTTP connection (the exporter's thread)."""

    def __init__(self, endpoint: str | None = None, timeout_s: float | None = None) -> None:
        url = endpoint or traces_endpoint()
        if not url:
            raise ValueError("no OTLP endpoint: set OTEL_EXPORTER_OTLP_ENDPOINT")
        self._url = urlparse(url)
        if self._url.scheme not in ("http", "https"):
            raise ValueError(f"OTLP/JSON needs an http(s) endpoint, got {url!r}")
        self._path = self._url.path or "/v1/traces"
        env_timeout = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")
        self._timeout = timeout_s if timeout_s is not None else (float(env_timeout) / 1000 if env_timeout else 10.0)
        self._conn: http.client.HTTPConnection | None = None
        self._failing = False

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
            self._conn = cls(self._url.hostname or "localhost", self._url.port, timeout=self._timeout)
        return self._conn

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        body = encode(spans)
        for attempt in (1, 2):   # a kept-alive connection the server closed: reconnect once
            try:
                conn = self._connection()
                conn.request("POST", self._path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                if 200 <= resp.status < 300:
                    if self._failing:
                        log.info("OTLP/JSON export to %s recovered", self._url.geturl())
                    self._failing = False
                    return SpanExportResult.SUCCESS
                return self._failed(f"HTTP {resp.status}")
            except (OSError, http.client.HTTPException) as exc:
                self._close()
                if attempt == 2:
                    return self._failed(str(exc))
        return SpanExportResult.FAILURE

    def _failed(self, why: str) -> SpanExportResult:
        if not self._failing:
            log.warning("OTLP/JSON export to %s failed (%s); dropping spans until it recovers", self._url.geturl(), why)
        self._failing = True
        return SpanExportResult.FAILURE

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def shutdown(self) -> None:
        self._close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
