"""The per-request hit-rate decomposition (shared/DESIGN.md) from traces, joined with the
client-side TTFT of the run's requests.jsonl by trace id.

available − predicted = cache lost to routing; predicted − delivered = cache lost to a stale
index or eviction. Fractions are token-weighted over prompt tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvlab.load.measure import Record
from kvlab.telemetry import names as n
from kvlab.traces.decision import decision_of
from kvlab.traces.span import Trace


@dataclass(frozen=True)
class RequestHits:
    trace_id: str
    start_ns: int
    policy: str | None
    replica: str | None
    prompt_tokens: int
    available: int
    predicted: int
    delivered: int
    ttft_ms: float | None       # client-side (requests.jsonl), else the client span's attribute
    routing_ms: float
    phase: str | None
    workload: str | None


def request_hits(traces: Iterable[Trace], requests: Iterable[Record] = ()) -> list[RequestHits]:
    """One row per gateway request found in `traces`, ordered by start time."""
    clients = {r.trace_id.lower(): r for r in requests if r.trace_id}
    rows = []
    for t in traces:
        d = decision_of(t)
        if d is None:
            continue
        client = clients.get(t.trace_id)
        ttft = client.ttft_ms if client else None
        client_span = t.first(n.SPAN_CLIENT_REQUEST)
        if ttft is None and client_span is not None:
            seconds = client_span.attr(n.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK)
            ttft = seconds * 1000 if isinstance(seconds, int | float) else None
        delivered = d.delivered if d.delivered is not None else (client.cached_tokens if client else None)
        rows.append(RequestHits(
            trace_id=t.trace_id, start_ns=t.start_ns,
            policy=d.policy or (client.policy if client else None),
            replica=d.chosen or (client.replica if client else None),
            prompt_tokens=int(d.prompt_tokens or (client.prompt_tokens if client else 0) or 0),
            available=int(d.available or 0), predicted=int(d.predicted or 0), delivered=int(delivered or 0),
            ttft_ms=float(ttft) if ttft is not None else None, routing_ms=d.routing_ms,
            phase=client.phase if client else None,
            workload=(client.workload if client else None) or t.attr(n.WORKLOAD)))
    rows.sort(key=lambda r: r.start_ns)
    return rows


def summarize(rows: Iterable[RequestHits]) -> dict[str, dict[str, float]]:
    """Per policy: requests, token-weighted available/predicted/delivered fractions, and client
    TTFT p50/p95 (ms, NaN when no request was joined with a client record)."""
    by_policy: dict[str, list[RequestHits]] = {}
    for r in rows:
        by_policy.setdefault(r.policy or "?", []).append(r)
    out = {}
    for policy, rs in by_policy.items():
        prompt = sum(r.prompt_tokens for r in rs) or 1
        ttfts = np.array([r.ttft_ms for r in rs if r.ttft_ms is not None], dtype=float)
        out[policy] = {
            "requests": float(len(rs)),
            "available": sum(r.available for r in rs) / prompt,
            "predicted": sum(r.predicted for r in rs) / prompt,
            "delivered": sum(r.delivered for r in rs) / prompt,
            "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts.size else float("nan"),
            "ttft_p95_ms": float(np.percentile(ttfts, 95)) if ttfts.size else float("nan"),
            "joined": float(ttfts.size),
        }
    return out
