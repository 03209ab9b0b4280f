"""Queue scorer: fewer waiting requests (scraped `vllm:num_requests_waiting`) is better."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer, normalised_inverse
from kvlab.gateway.scheduler.registry import plugin


@plugin
class QueueScorer(Scorer):
    name = "queue"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return normalised_inverse([c.replica.waiting for c in candidates])
