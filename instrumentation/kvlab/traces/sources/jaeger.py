"""Spans from a Jaeger v2 query service through its OTLP query API, `api_v3` (pinned: Jaeger 2.x,
the `jaeger` binary / the jaegertracing/jaeger image; port 16686 by default).

The HTTP binding of jaeger-idl's `proto/api_v3/query_service.proto`: `GET /api/v3/services`
→ `{"services": [...]}`; `GET /api/v3/traces?query.service_name=S&query.start_time_min=T&
query.start_time_max=T&query.search_depth=N` (RFC 3339 times, both required) and `GET
/api/v3/traces/{trace_id}` → `{"result": <OTLP TracesData>}`, i.e. `resourceSpans` in OTLP/JSON
with hex ids. No matching trace is a 404 with `{"error": {"httpCode": 404, "message": ...}}`.
The spans are read by the same OTLP/JSON parser as the sink's files (`otlp_files.spans_of_request`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from typing import Any

from kvlab.errors import KvlabError
from kvlab.traces.sources.base import TraceSource
from kvlab.traces.sources.otlp_files import spans_of_request
from kvlab.traces.span import Span, Trace, group_traces


def _rfc3339(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _results(text: str) -> list[dict[str, Any]]:
    """The `result` objects of a response: one today; newline-separated ones if Jaeger streams
    several chunks (query_service.proto's GRPCGatewayWrapper)."""
    out = []
    for line in text.splitlines() or [text]:
        if line.strip():
            body = json.loads(line)
            if body.get("error"):
                raise KvlabError(str(body["error"].get("message", body["error"])))
            out.append(body.get("result") or {})
    return out


class JaegerSource(TraceSource):
    """Reads traces over HTTP from a Jaeger query service at `base_url` (e.g. http://127.0.0.1:16686)."""

    def __init__(self, base_url: str, lookback_s: float = 86400.0, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.lookback_s = lookback_s
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return f"Jaeger at {self.base_url}"

    def _get(self, path: str, **params: Any) -> str | None:
        """The response body, or None on a 404 (Jaeger's answer to "no traces")."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.base_url}{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                body: bytes = resp.read()
                return body.decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise KvlabError(f"{url}: HTTP {exc.code} {exc.read()[:200].decode(errors='replace')}") from None
        except OSError as exc:
            raise KvlabError(f"cannot read {url}: {exc}") from None

    def _spans(self, path: str, **params: Any) -> list[Span]:
        text = self._get(path, **params)
        try:
            return [s for result in _results(text or "") for s in spans_of_request(result)]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KvlabError(f"{self.describe()}: not an OTLP/JSON answer: {exc}") from None

    def services(self) -> list[str]:
        text = self._get("/api/v3/services")
        try:
            return sorted(json.loads(text or "{}").get("services") or [])
        except ValueError as exc:
            raise KvlabError(f"{self.describe()}: bad services answer: {exc}") from None

    def traces(self, limit: int | None = None, service: str | None = None) -> list[Trace]:
        now = time.time()
        window = {"query.start_time_min": _rfc3339(now - self.lookback_s), "query.start_time_max": _rfc3339(now + 60)}
        depth = limit or 1000
        spans: list[Span] = []
        for svc in [service] if service else self.services():
            # query.num_traces is the name Jaeger releases before the search_depth rename read
            spans += self._spans("/api/v3/traces", **{"query.service_name": svc, **window,
                                                      "query.search_depth": depth, "query.num_traces": depth})
        found = group_traces(spans)
        return found[-limit:] if limit else found

    def trace(self, trace_id: str) -> Trace:
        spans = self._spans(f"/api/v3/traces/{trace_id.lower()}")
        if not spans:
            raise KvlabError(f"trace {trace_id} not found in {self.describe()}")
        return Trace(spans[0].trace_id, spans)
