"""A routing decision read back from the gateway's schedule span: every candidate replica with
its per-scorer scores, total and cached prefix, the weights, the chosen replica and the reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlab.telemetry import names as n
from kvlab.traces.span import Span, Trace

_GATEWAY_SPANS = (n.SPAN_GATEWAY_REQUEST, n.SPAN_SCHEDULE)


@dataclass(frozen=True)
class Candidate:
    replica: str
    scores: dict[str, float]
    total: float | None
    prefix_tokens: int | None
    chosen: bool
    extra: dict[str, Any] = field(default_factory=dict)   # anything else the gateway recorded


@dataclass(frozen=True)
class Decision:
    trace_id: str
    policy: str | None
    chosen: str | None
    reason: str | None
    shadow: bool                    # scores computed but not used (the cache-blind baseline)
    weights: dict[str, float]
    candidates: list[Candidate]
    prompt_tokens: int | None
    available: int | None
    predicted: int | None
    speculative: int | None         # the part of predicted not yet confirmed by KV events
    delivered: int | None
    attempts: int
    routing_ms: float

    @property
    def scorers(self) -> list[str]:
        """Scorer names: the weights' order, then any other scorer a candidate reports."""
        names = list(self.weights)
        for c in self.candidates:
            names += [s for s in c.scores if s not in names]
        return names


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _float(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _candidate(raw: dict[str, Any], chosen: str | None) -> Candidate:
    replica = str(raw.get("replica") or raw.get("name") or raw.get("endpoint") or "?")
    scores = {str(k): float(v) for k, v in (raw.get("scores") or {}).items() if _float(v) is not None}
    known = {"replica", "name", "endpoint", "scores", "total", "score", "prefix_tokens", "chosen"}
    return Candidate(
        replica=replica, scores=scores,
        total=_float(raw.get("total", raw.get("score"))),
        prefix_tokens=_int(raw.get("prefix_tokens")),
        chosen=bool(raw.get("chosen")) or replica == chosen,
        extra={k: v for k, v in raw.items() if k not in known})


def decision_of(trace: Trace) -> Decision | None:
    """The decision of the last schedule attempt of a gateway request; None if the trace has none.
    A P/D split's prefill-pool run (profile `prefill`, under pick_disagg_profile) is not one."""
    schedules = [s for s in trace.find(n.SPAN_SCHEDULE) if s.attr(n.LLMD_PROFILE_NAME) != n.PROFILE_PREFILL]
    if not schedules:
        return None
    span: Span = max(schedules, key=lambda s: (_int(s.attr(n.SCHEDULE_ATTEMPT)) or 0, s.start_ns))
    chosen = span.attr(n.SCHEDULE_CHOSEN) or trace.attr(n.REPLICA, [n.SPAN_GATEWAY_REQUEST, n.SPAN_UPSTREAM])
    raw_candidates = span.json_attr(n.SCHEDULE_CANDIDATES, [])
    weights = span.json_attr(n.SCHEDULE_WEIGHTS, {}) or {}

    def pick(key: str) -> Any:
        value = span.attr(key)
        return value if value is not None else trace.attr(key, _GATEWAY_SPANS)

    delivered = pick(n.PREFIX_DELIVERED_TOKENS)
    if delivered is None:
        delivered = trace.attr(n.ENGINE_CACHED_TOKENS, [n.SPAN_ENGINE_REQUEST, n.SPAN_ENGINE_PREFILL])
    return Decision(
        trace_id=trace.trace_id,
        policy=pick(n.POLICY),
        chosen=str(chosen) if chosen is not None else None,
        reason=span.attr(n.SCHEDULE_REASON),
        shadow=bool(span.attr(n.SCHEDULE_SHADOW, False)),
        weights={str(k): float(v) for k, v in weights.items() if _float(v) is not None},
        candidates=[_candidate(c, chosen) for c in raw_candidates if isinstance(c, dict)],
        prompt_tokens=_int(pick(n.PROMPT_TOKENS) or pick(n.GEN_AI_USAGE_INPUT_TOKENS)),
        available=_int(pick(n.PREFIX_AVAILABLE_TOKENS)),
        predicted=_int(pick(n.PREFIX_PREDICTED_TOKENS)),
        speculative=_int(pick(n.PREFIX_SPECULATIVE_TOKENS)),
        delivered=_int(delivered),
        attempts=len(schedules),
        routing_ms=sum(s.duration_ms for s in schedules),
    )
