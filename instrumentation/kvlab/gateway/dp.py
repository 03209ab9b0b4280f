"""Data-parallel awareness in decisions: why the chosen rank and not its sibling ranks.

A wide-EP replica exposes one endpoint per data-parallel rank (`Endpoint.dp_rank`,
`Endpoint.replica`); the scheduler scores ranks like any endpoint. This module explains a
decision at rank level for the schedule span (`kvlab.dp.rank_reason`, `kvlab.dp.siblings`).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from kvlab.gateway.scheduler.base import Candidate, Decision


def siblings(decision: Decision) -> list[Candidate]:
    """Every scored candidate on the same replica as the chosen rank (itself included)."""
    rep = decision.chosen.replica.endpoint.replica
    if rep is None:
        return [decision.chosen]
    return [c for c in decision.candidates if c.replica.endpoint.replica == rep]


def rank_reason(decision: Decision) -> str:
    """One of: not-data-parallel, rank-blind, only-rank, prefix-on-rank, least-loaded-rank,
    load-over-prefix (a sibling held a longer prefix but was busier)."""
    chosen = decision.chosen
    if chosen.replica.endpoint.dp_rank is None:
        return "not-data-parallel"
    if decision.shadow:
        return decision.reason        # the picker ignored rank scores (e.g. "rank-blind")
    others = [c for c in siblings(decision) if c is not chosen]
    if not others:
        return "only-rank"
    best_prefix = max(c.prefix_tokens for c in others)
    if chosen.prefix_tokens > best_prefix:
        return "prefix-on-rank"
    if chosen.prefix_tokens < best_prefix:
        return "load-over-prefix"
    return "least-loaded-rank"


def sibling_view(decision: Decision) -> list[dict[str, Any]]:
    """[{rank, name, prefix_tokens, waiting, inflight_tokens, total}] for the span (JSON)."""
    return [{"rank": c.replica.endpoint.dp_rank, "name": c.name, "prefix_tokens": c.prefix_tokens,
             "waiting": c.replica.waiting, "inflight_tokens": c.replica.inflight_tokens,
             "total": round(c.total, 4)} for c in siblings(decision)]


def annotate(span: trace.Span, decision: Decision) -> None:
    """The schedule span's rank attributes: which rank of which replica, why, and its siblings."""
    import json

    from kvlab.telemetry import names

    e = decision.chosen.replica.endpoint
    if e.dp_rank is None:
        return
    span.set_attribute(names.DP_RANK, e.dp_rank)
    span.set_attribute(names.DP_REPLICA, e.replica or e.name)
    span.set_attribute(names.DP_REASON, rank_reason(decision))
    span.set_attribute(names.DP_SIBLINGS, json.dumps(sibling_view(decision)))
