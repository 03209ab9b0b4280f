"""Evaluate every panel query of every kvlab dashboard against a Prometheus, the way Grafana would
(its `$__rate_interval` / `$__interval` / `$__range` macros replaced), and say which ones error,
return no series or only NaN. The dashboard proof test and `kvlab dashboards --verify` use it."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from kvlab.dashboards.catalog import DASHBOARDS, dashboard_json, panel_queries, pending_reason


@dataclass(frozen=True)
class QueryResult:
    uid: str
    panel: str
    ref: str
    expr: str
    series: int
    finite: int          # points with a finite value, over all series
    error: str | None
    pending: str | None  # why no data is expected yet (an open issue), else None

    @property
    def ok(self) -> bool:
        if self.error:
            return False
        return self.pending is not None or (self.series > 0 and self.finite > 0)

    @property
    def problem(self) -> str:
        if self.error:
            return f"error: {self.error}"
        if self.series == 0:
            return "no series"
        if self.finite == 0:
            return "only NaN/Inf values"
        return ""


def grafana_expr(expr: str, rate_interval_s: int, step_s: int, range_s: int) -> str:
    """Replace Grafana's macros as Grafana does before it sends a query."""
    return (expr.replace("$__rate_interval", f"{rate_interval_s}s")
            .replace("$__interval", f"{step_s}s").replace("$__range", f"{range_s}s"))


def query_range(base_url: str, expr: str, start: float, end: float, step_s: int) -> list[dict[str, Any]]:
    """Prometheus /api/v1/query_range; ValueError with Prometheus's message on a bad query."""
    body = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                   "step": f"{step_s}s"}).encode()
    req = urllib.request.Request(f"{base_url.rstrip('/')}/api/v1/query_range", data=body,
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            data = json.load(exc)
        except ValueError:
            raise ValueError(f"HTTP {exc.code}") from None
    if data.get("status") != "success":
        raise ValueError(f"{data.get('errorType')}: {data.get('error')}")
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


def verify(base_url: str, start: float, end: float, step_s: int = 2, rate_interval_s: int = 10) -> list[QueryResult]:
    """Every query of every dashboard, evaluated over [start, end] (Unix seconds)."""
    results = []
    range_s = max(1, int(end - start))
    for module in DASHBOARDS.values():
        data = dashboard_json(module)
        uid = data["uid"]
        for title, ref, expr in panel_queries(data):
            series = finite = 0
            error = None
            try:
                found = query_range(base_url, grafana_expr(expr, rate_interval_s, step_s, range_s), start, end, step_s)
                series = len(found)
                finite = sum(1 for s in found for _, v in s.get("values", []) if math.isfinite(float(v)))
            except (ValueError, OSError) as exc:
                error = str(exc)
            results.append(QueryResult(uid, title, ref, expr, series, finite, error, pending_reason(uid, expr)))
    return results
