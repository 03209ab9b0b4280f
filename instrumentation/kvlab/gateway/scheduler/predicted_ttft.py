"""Predicted-TTFT scorer: the replica expected to return the first token soonest is better.

Predicted TTFT = the replica's learned prefill cost per token (`gateway/prefill.py`, an EWMA of
observed TTFT / prefill work) x (prefill tokens queued ahead of this request there + this
request's own uncached tokens there, i.e. prompt minus the cached prefix). It weighs cache and load
in one unit of time: a replica holding the prefix but with a long queue can lose to an idle one.
A replica without a sample yet is assumed as costly as the mean of those with one (all equal when
none has: then the prediction ranks by tokens alone)."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer, normalised_inverse
from kvlab.gateway.scheduler.registry import plugin


def predicted_ttft_ms(req: RouteRequest, candidates: list[Candidate]) -> list[float]:
    known = [c.replica.prefill_ms_per_token for c in candidates if c.replica.prefill_ms_per_token is not None]
    default = sum(known) / len(known) if known else 1.0
    out = []
    for c in candidates:
        cost = c.replica.prefill_ms_per_token
        own = max(req.prompt_tokens - c.prefix_tokens, 0)
        out.append((default if cost is None else cost) * (c.replica.pending_prefill_tokens + own))
    return out


@plugin
class PredictedTtftScorer(Scorer):
    name = "predicted_ttft"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return normalised_inverse(predicted_ttft_ms(req, candidates))
