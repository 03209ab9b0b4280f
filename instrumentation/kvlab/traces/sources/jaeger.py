"""Spans from a Jaeger v2 query service (pinned: Jaeger 2.x, the `jaeger` binary / the
jaegertracing/jaeger image, whose HTTP JSON API `/api/services`, `/api/traces?service=..` and
`/api/traces/{id}` the Jaeger UI itself uses; port 16686 by default). The JSON model is Jaeger's
`model/json`: spans with `traceID`, `spanID`, `references`, `startTime`/`duration` in
microseconds, typed `tags`, `logs`, and `processes` that name the service."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvlab.errors import KvlabError
from kvlab.traces.sources.base import TraceSource
from kvlab.traces.span import Span, SpanEvent, Trace, group_traces

_STATUS_TAGS = {"span.kind", "otel.status_code", "otel.status_description", "error"}


def _tag_value(tag: dict[str, Any]) -> Any:
    kind, value = tag.get("type", "string"), tag.get("value")
    if kind == "int64":
        return int(value)
    if kind == "float64":
        return float(value)
    if kind == "bool":
        return value if isinstance(value, bool) else str(value).lower() == "true"
    return value


def _tags(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {t["key"]: _tag_value(t) for t in items or []}


def spans_of_trace(data: dict[str, Any]) -> list[Span]:
    """The spans of one element of a Jaeger `/api/traces` response's `data` list."""
    processes = data.get("processes") or {}
    out = []
    for raw in data.get("spans") or []:
        tags = _tags(raw.get("tags"))
        trace_id = raw["traceID"].lower().zfill(32)
        parent = next((r["spanID"] for r in raw.get("references") or []
                       if r.get("refType") == "CHILD_OF" and r.get("traceID", "").lower().zfill(32) == trace_id),
                      raw.get("parentSpanID") or None)
        start_ns = int(raw["startTime"]) * 1000
        if tags.get("otel.status_code") == "ERROR" or tags.get("error") is True:
            status = "error"
        elif tags.get("otel.status_code") == "OK":
            status = "ok"
        else:
            status = "unset"
        service = (processes.get(raw.get("processID")) or {}).get("serviceName") or "unknown"
        events = []
        for entry in raw.get("logs") or []:
            fields = _tags(entry.get("fields"))
            events.append(SpanEvent(str(fields.pop("event", "log")), int(entry.get("timestamp", 0)) * 1000, fields))
        out.append(Span(
            trace_id=trace_id, span_id=raw["spanID"].lower().zfill(16),
            parent_id=parent.lower().zfill(16) if parent else None,
            name=raw.get("operationName", ""), service=service,
            kind=str(tags.get("span.kind", "internal")), start_ns=start_ns,
            end_ns=start_ns + int(raw.get("duration", 0)) * 1000,
            attributes={k: v for k, v in tags.items() if k not in _STATUS_TAGS},
            status=status, status_message=str(tags.get("otel.status_description", "")),
            events=tuple(events)))
    return out


class JaegerSource(TraceSource):
    """Reads traces over HTTP from a Jaeger query service at `base_url` (e.g. http://127.0.0.1:16686)."""

    def __init__(self, base_url: str, lookback: str = "24h", timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.lookback = lookback
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return f"Jaeger at {self.base_url}"

    def _get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.base_url}{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise KvlabError(f"{url}: not found") from None
            raise KvlabError(f"{url}: HTTP {exc.code}") from None
        except (OSError, ValueError) as exc:
            raise KvlabError(f"cannot read {url}: {exc}") from None
        if body.get("errors"):
            raise KvlabError(f"{url}: {body['errors']}")
        return body.get("data")

    def services(self) -> list[str]:
        return sorted(self._get("/api/services") or [])

    def traces(self, limit: int | None = None, service: str | None = None) -> list[Trace]:
        services = [service] if service else self.services()
        spans: list[Span] = []
        for svc in services:
            for data in self._get("/api/traces", service=svc, limit=limit or 1000, lookback=self.lookback) or []:
                spans.extend(spans_of_trace(data))
        found = group_traces(spans)
        return found[-limit:] if limit else found

    def trace(self, trace_id: str) -> Trace:
        data = self._get(f"/api/traces/{trace_id.lower()}") or []
        spans = [s for d in data for s in spans_of_trace(d)]
        if not spans:
            raise KvlabError(f"trace {trace_id} not found in {self.describe()}")
        return Trace(spans[0].trace_id, spans)
