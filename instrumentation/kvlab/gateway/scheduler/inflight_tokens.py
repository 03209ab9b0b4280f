"""In-flight-tokens scorer: less prefill work the gateway has sent and not yet seen answered is
better. Per data-parallel rank this is the load signal that matters: a rank with two 4,000-token
prompts in flight is busier than one with five short chats, which a request count cannot tell.
Counted at dispatch as prompt tokens minus the predicted cached prefix (the tokens it must compute)."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer, normalised_inverse
from kvlab.gateway.scheduler.registry import plugin


@plugin
class InflightTokensScorer(Scorer):
    name = "inflight_tokens"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return normalised_inverse([float(c.replica.inflight_tokens) for c in candidates])
