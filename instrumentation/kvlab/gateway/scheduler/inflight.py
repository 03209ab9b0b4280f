"""In-flight scorer: fewer requests the gateway itself has open to the replica is better. Exact
and instantaneous, unlike the scraped queue which lags by up to one scrape interval."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer, normalised_inverse
from kvlab.gateway.scheduler.registry import plugin


@plugin
class InflightScorer(Scorer):
    name = "inflight"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return normalised_inverse([float(c.replica.inflight) for c in candidates])
