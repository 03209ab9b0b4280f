"""What the `gateway.schedule` span says about one routing decision: every candidate's scores and
load, the index each replica was looked up in, the prefix split by tier and by retention class,
and the pull decision (docs/DESIGN.md, span conventions). Written only when the span records."""

from __future__ import annotations

from typing import Any

import msgspec
from opentelemetry import trace

from kvlab.gateway import dp as dp_view
from kvlab.gateway.router import Routed, Router
from kvlab.telemetry import names


def _json(value: Any) -> str:
    """JSON text for a span attribute (msgspec: a fraction of json.dumps' cost on the hot path)."""
    return msgspec.json.encode(value).decode()


def annotate(s: trace.Span, routed: Routed, router: Router, policy: str, prompt_tokens: int,
             typed: str | None) -> None:
    d = routed.decision
    s.set_attribute(names.POLICY, policy)
    s.set_attribute(names.SCHEDULE_CHOSEN, d.chosen.name)
    s.set_attribute(names.SCHEDULE_REASON, d.reason)
    dp_view.annotate(s, d)
    s.set_attribute(names.SCHEDULE_SHADOW, d.shadow)
    s.set_attribute(names.SCHEDULE_SHADOW_CHOICE, d.best.name)
    s.set_attribute(names.SCHEDULE_WEIGHTS, _json(router.ranker.weights))
    s.set_attribute(names.SCHEDULE_CANDIDATES, _json([
        {"replica": c.name, "prefix_tokens": c.prefix_tokens,
         "speculative_tokens": c.speculative_tokens,
         "scores": {k: round(v, 4) for k, v in c.scores.items()}, "total": round(c.total, 4),
         "waiting": c.replica.waiting, "running": c.replica.running,
         "kv_usage": round(c.replica.kv_usage, 4), "inflight": c.replica.inflight,
         "inflight_tokens": c.replica.inflight_tokens,
         "pending_prefill_tokens": c.replica.pending_prefill_tokens,
         "prefill_ms_per_token": c.replica.prefill_ms_per_token,
         "filtered": c.name in d.filtered}
        for c in d.candidates]))
    s.set_attribute(names.SCHEDULE_INDEX, _json(routed.index_of))
    s.set_attribute(names.SCHEDULE_KEYS_MS, routed.keys_s * 1000)
    s.set_attribute(names.PREFIX_AVAILABLE_TOKENS, d.available_tokens)
    s.set_attribute(names.PREFIX_PREDICTED_TOKENS, d.predicted_tokens)
    s.set_attribute(names.PREFIX_SPECULATIVE_TOKENS, d.speculative_tokens)
    s.set_attribute(names.PROMPT_TOKENS, prompt_tokens)
    if routed.cpu:   # tier-split prefixes (docs/tiered.md)
        s.set_attribute(names.PREFIX_TIERS, _json([
            {"replica": c.name, "gpu_tokens": c.prefix_tokens - c.cpu_tokens, "cpu_tokens": c.cpu_tokens}
            for c in d.candidates]))
        s.set_attribute(names.PREFIX_CPU_TOKENS, d.chosen.cpu_tokens)
    if typed is not None:
        # the directives sent and, from the index, the retention classes of the chosen replica's prefix
        s.set_attribute(names.RETENTION_DIRECTIVES, typed)
        keys = routed.keys_by_size.get(router.block_size(d.chosen.replica), [])
        s.set_attribute(names.RETENTION_PREFIX_CLASSES, _json(router.precise.prefix_classes(d.chosen.name, keys)))


def annotate_pull(tracer: trace.Tracer, routed: Routed) -> None:
    """A `gateway.pull_decision` span when a busy holder of the prefix was passed over (docs/tiered.md)."""
    p = routed.pull
    if p is None:
        return
    with tracer.start_as_current_span(names.SPAN_PULL_DECISION) as ps:
        ps.set_attributes({names.PULL_CHOICE: p.choice, names.PULL_HOLDER: p.holder,
                           names.PULL_TARGET: p.target, names.PULL_HOLDER_TOKENS: p.holder_prefix,
                           names.PULL_COSTS: _json({k: round(v, 2) for k, v in p.costs.items()})})
