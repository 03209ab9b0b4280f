"""The gateway's prefill/decode decision, without I/O: `gateway/pd.py` carries it out over HTTP,
`kvlab twin` in virtual time; both call `plan_split`, so the twin splits exactly what the live
gateway splits (docs/pd.md, "The decision")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlab.gateway.config import PDSettings
from kvlab.gateway.endpoints import Backend, Registry
from kvlab.gateway.router import Routed, Router
from kvlab.gateway.scheduler.base import Candidate, Decision, RouteRequest
from kvlab.kvcache.hashing import block_keys

SPLIT, UNIFIED = "split", "unified"


def decide(settings: PDSettings, prompt_tokens: int, decode_prefix_tokens: int,
           prefill_available: bool) -> tuple[str, str, int]:
    """(decision, reason, uncached tokens on the decode replica). Reasons: no-prefill-replica,
    short-prompt, cached-on-decode (unified); uncached-above-threshold (split)."""
    uncached = max(0, prompt_tokens - decode_prefix_tokens)
    if not prefill_available:
        return UNIFIED, "no-prefill-replica", uncached
    if prompt_tokens < settings.threshold_tokens:
        return UNIFIED, "short-prompt", uncached
    if uncached < settings.threshold_tokens:
        return UNIFIED, "cached-on-decode", uncached
    return SPLIT, "uncached-above-threshold", uncached


@dataclass(slots=True)
class PDPlan:
    decision: str
    reason: str
    uncached_tokens: int
    prefill: list[Candidate] = field(default_factory=list)   # prefill replicas in the order to try
    prefill_decision: Decision | None = None                  # the prefill pool's scheduling, on a split


def prefill_replicas(registry: Registry) -> list[Backend] | None:
    """Healthy prefill-role replicas; None when the topology has none at all (P/D off)."""
    pool = [r for r in registry.replicas.values() if r.endpoint.role == "prefill"]
    return [r for r in pool if r.healthy] if pool else None


def plan_split(settings: PDSettings, router: Router, prefills: list[Backend], tokens: Sequence[int],
               routed: Routed) -> PDPlan:
    """The decision for a routed request and, on a split, the prefill replicas ranked by the same
    scheduler over the prefill pool (the gateway and `kvlab twin` both call this)."""
    decision, reason, uncached = decide(settings, len(tokens), routed.decision.chosen.prefix_tokens, bool(prefills))
    plan = PDPlan(decision, reason, uncached)
    if decision == SPLIT:
        keys = dict(routed.keys_by_size)
        for bs in {router.block_size(r) for r in prefills} - keys.keys():
            keys[bs] = block_keys(tokens, bs)
        prefix, _, _ = router.prefix_of(prefills, keys, len(tokens))
        d = router.ranker.schedule(RouteRequest(len(tokens)), prefills, prefix)
        plan.prefill, plan.prefill_decision = d.ranked, d
    return plan
