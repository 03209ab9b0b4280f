"""Prefix scorer: the share of the prompt already cached on the replica (precise or approximate
index, looked up before scheduling). 1.0 = the whole prompt would be a cache hit."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer


class PrefixScorer(Scorer):
    name = "prefix"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        n = max(req.prompt_tokens, 1)
        return [min(c.prefix_tokens / n, 1.0) for c in candidates]
