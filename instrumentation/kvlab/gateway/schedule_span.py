"""One routing decision as llm-d traces it, with what only kvlab records.

llm-d's scheduler (llm-d/llm-d-router pkg/epp/scheduling/scheduler_profile.go) opens, under
`run_scheduler_profile`, `filter_endpoints`, `llm_d.epp.scoring` with one `llm_d.epp.scorer.<type>`
child per scorer (its weight and the max/avg of its scores, no per-endpoint keys) and
`pick_endpoints` (the best few endpoints and their weighted scores); its KV-block index lookup is
`index_lookup` (pkg/kvcache/kvblock/traced_index.go). kvlab writes the same spans, after the fact
from the times the router and ranker took (gateway/scheduler/base.py Phases), and keeps on
`run_scheduler_profile` what llm-d does not record: every candidate's per-scorer scores and load,
the index each replica was looked up in, the prefix split by tier and by retention class, the
decision in words and the pull decision (docs/tracing.md). Written only when the span records."""

from __future__ import annotations

from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

from kvlab.gateway import dp as dp_view
from kvlab.gateway.router import Routed, Router
from kvlab.gateway.scheduler.base import Decision, Ranker
from kvlab.telemetry import names
from kvlab.telemetry.recorder import RecordedSpan


def _json(value: Any) -> str:
    """JSON text for a span attribute (msgspec: a fraction of json.dumps' cost on the hot path)."""
    return msgspec.json.encode(value).decode()


def annotate(tracer: trace.Tracer, s: trace.Span, routed: Routed, router: Router, policy: str,
             prompt_tokens: int, typed: str | None, profile: str = names.PROFILE_DEFAULT) -> None:
    d = routed.decision
    s.set_attribute(names.LLMD_PROFILE_NAME, profile)
    parent = trace.set_span_in_context(s)
    lookup(tracer, parent, routed, router)
    steps(tracer, parent, d, router.ranker)
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


def lookup(tracer: trace.Tracer, parent: Context, routed: Routed, router: Router) -> None:
    """`index_lookup`: the request's blocks, how many some replica holds (the longest prefix found,
    in blocks: block keys chain, so a replica holding block i holds those before it) and over how
    many replicas."""
    start, end = routed.lookup_ns
    if not start:
        return
    d = routed.decision
    sizes = [router.block_size(c.replica) for c in d.candidates]
    found = max((c.prefix_tokens // bs for c, bs in zip(d.candidates, sizes) if bs), default=0)
    blocks = max((len(k) for k in routed.keys_by_size.values()), default=0)
    _Children(tracer, parent).add(names.SPAN_INDEX_LOOKUP, start, end, {
        names.LLMD_INDEX_LOOKUP_BLOCKS: blocks, names.LLMD_LOOKUP_POD_FILTER: len(d.candidates),
        names.LLMD_LOOKUP_CACHE_HIT: found > 0, names.LLMD_LOOKUP_BLOCKS_FOUND: found})


def steps(tracer: trace.Tracer, parent: Context, d: Decision, ranker: Ranker) -> None:
    """filter_endpoints, llm_d.epp.scoring (one llm_d.epp.scorer.<type> per scorer of the policy:
    those with a weight, as an llm-d profile lists them; kvlab's shadow scores of the others are in
    kvlab.schedule.candidates) and pick_endpoints, with llm-d's attributes."""
    p = d.phases
    if p is None:
        return
    kept = [c for c in d.candidates if c.name not in d.filtered] if d.filtered else d.candidates
    children = _Children(tracer, parent)
    children.add(names.SPAN_FILTER, p.filter_start, p.scoring_start, {
        names.LLMD_FILTER_CANDIDATES: len(d.candidates), names.LLMD_FILTER_FILTERED: len(kept)})
    weighted = [(scorer, weight, times) for (scorer, weight), times in zip(ranker.scorers, p.scorers) if weight]
    scoring = children.add(names.SPAN_SCORING, p.scoring_start, p.pick_start, {
        names.LLMD_SCORER_COUNT: len(weighted), names.LLMD_SCORING_CANDIDATES: len(kept)})
    for scorer, weight, (start, end) in weighted:
        scores = [c.scores[scorer.name] for c in kept if scorer.name in c.scores]
        attrs: dict[str, AttributeValue] = {
            names.LLMD_SCORER_TYPE: scorer.name, names.LLMD_SCORER_NAME: scorer.name,
            names.LLMD_SCORER_WEIGHT: float(weight), names.LLMD_SCORER_CANDIDATES: len(kept)}
        if scores:
            attrs[names.LLMD_SCORER_SCORE_MAX] = max(scores)
            attrs[names.LLMD_SCORER_SCORE_AVG] = sum(scores) / len(scores)
            attrs[names.LLMD_SCORER_ENDPOINTS_SCORED] = len(scores)
        children.add(names.SPAN_SCORER_PREFIX + scorer.name, start, end, attrs, under=scoring)
    top = sorted(kept, key=lambda c: -c.total)[:names.LLMD_PICKER_TOP_N]
    children.add(names.SPAN_PICK, p.pick_start, p.end, {
        names.LLMD_PICKER_CANDIDATES: len(kept), names.LLMD_PICKER_TOP_ENDPOINTS: [c.name for c in top],
        names.LLMD_PICKER_TOP_SCORES: [round(c.total, 4) for c in top]})


class _Children:
    """Ended child spans of the span in `parent`, written after the fact. Under kvlab's recorder
    they are packed straight for the relay (`RecordedSpan.record_child`: ~10 spans a sampled
    request, no Span object each); under the SDK's provider they are its spans."""

    def __init__(self, tracer: trace.Tracer, parent: Context) -> None:
        self._tracer = tracer
        self._parent = parent
        span = trace.get_current_span(parent)
        self._recorded = span if isinstance(span, RecordedSpan) else None

    def add(self, name: str, start: int, end: int, attrs: dict[str, AttributeValue],
            under: int | trace.Span | None = None) -> int | trace.Span:
        """The child (of `under`, a child added before, when given): a span id or a span, to be
        passed back as `under`."""
        if self._recorded is not None:
            return self._recorded.record_child(name, start, end, attrs, under if isinstance(under, int) else 0)
        context = trace.set_span_in_context(under) if isinstance(under, trace.Span) else self._parent
        span = self._tracer.start_span(name, context=context, start_time=start, attributes=attrs)
        span.end(end_time=end)
        return span


def annotate_pull(tracer: trace.Tracer, routed: Routed) -> None:
    """A `gateway.pull_decision` span when a busy holder of the prefix was passed over (docs/tiered.md)."""
    p = routed.pull
    if p is None:
        return
    with tracer.start_as_current_span(names.SPAN_PULL_DECISION) as ps:
        ps.set_attributes({names.PULL_CHOICE: p.choice, names.PULL_HOLDER: p.holder,
                           names.PULL_TARGET: p.target, names.PULL_HOLDER_TOKENS: p.holder_prefix,
                           names.PULL_COSTS: _json({k: round(v, 2) for k, v in p.costs.items()})})
