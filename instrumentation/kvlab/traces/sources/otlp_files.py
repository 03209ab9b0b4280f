"""Spans from OTLP/JSON lines: what `kvlab.telemetry.sink` writes under runs/<id>/traces/ (the
OpenTelemetry Collector's `file` exporter writes the same format, so its files read too)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvlab.errors import KvlabError
from kvlab.traces.sources.base import TraceSource
from kvlab.traces.span import Span, SpanEvent, Trace, group_traces

log = logging.getLogger(__name__)

_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS = {0: "unset", 1: "ok", 2: "error"}


def any_value(value: dict[str, Any]) -> Any:
    """An OTLP AnyValue as a plain Python value."""
    if not value:
        return None
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: any_value(kv.get("value") or {}) for kv in items or []}


def _hex_id(value: str | None, size: int) -> str | None:
    """Ids are hex in OTLP/JSON; accept protobuf-JSON base64 too."""
    if not value:
        return None
    if len(value) == size * 2:
        try:
            int(value, 16)
            return value.lower()
        except ValueError:
            pass
    raw = base64.b64decode(value)
    return raw.hex() if any(raw) else None


def _enum(value: Any, names: dict[int, str], prefix: str) -> str:
    if isinstance(value, str):  # "SPAN_KIND_SERVER" / "STATUS_CODE_ERROR"
        return value.removeprefix(prefix).lower() or names[0]
    return names.get(int(value or 0), names[0])


def spans_of_request(request: dict[str, Any]) -> Iterator[Span]:
    """The spans of one OTLP/JSON ExportTraceServiceRequest (or TracesData) object."""
    for rs in request.get("resourceSpans") or []:
        resource = attributes((rs.get("resource") or {}).get("attributes"))
        service = str(resource.get("service.name", "unknown"))
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
            for raw in ss.get("spans") or []:
                status = raw.get("status") or {}
                yield Span(
                    trace_id=_hex_id(raw["traceId"], 16) or "",
                    span_id=_hex_id(raw["spanId"], 8) or "",
                    parent_id=_hex_id(raw.get("parentSpanId"), 8),
                    name=raw.get("name", ""),
                    service=service,
                    kind=_enum(raw.get("kind"), _KINDS, "SPAN_KIND_"),
                    start_ns=int(raw.get("startTimeUnixNano") or 0),
                    end_ns=int(raw.get("endTimeUnixNano") or 0),
                    attributes=attributes(raw.get("attributes")),
                    status=_enum(status.get("code"), _STATUS, "STATUS_CODE_"),
                    status_message=status.get("message", ""),
                    events=tuple(SpanEvent(e.get("name", ""), int(e.get("timeUnixNano") or 0),
                                           attributes(e.get("attributes")))
                                 for e in raw.get("events") or []),
                )


def read_spans(path: Path) -> tuple[list[Span], int]:
    """All spans of `path` (a .jsonl file or a directory of them) and the number of bad lines."""
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    spans: list[Span] = []
    bad = 0
    for f in files:
        with f.open(encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    spans.extend(spans_of_request(json.loads(line)))
                except (ValueError, KeyError, TypeError, AttributeError):
                    bad += 1  # a line cut short by a crash, or not OTLP
    return spans, bad


class OtlpFileSource(TraceSource):
    """Every span under a directory of OTLP/JSON line files, loaded once."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise KvlabError(f"no trace files at {self.path}")
        spans, bad = read_spans(self.path)
        if bad:
            log.warning("%s: skipped %d unreadable lines", self.path, bad)
        self._traces = group_traces(spans)
        self._by_id = {t.trace_id: t for t in self._traces}

    def describe(self) -> str:
        return f"OTLP JSON files under {self.path}"

    def traces(self, limit: int | None = None, service: str | None = None) -> list[Trace]:
        found = [t for t in self._traces if service is None or service in t.services]
        return found[-limit:] if limit else found

    def trace(self, trace_id: str) -> Trace:
        try:
            return self._by_id[trace_id.lower()]
        except KeyError:
            raise KvlabError(f"trace {trace_id} not found in {self.describe()}") from None
