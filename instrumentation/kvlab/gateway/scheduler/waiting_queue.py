"""GIE's `queue-scorer`: the shortest waiting queue scores 1, the longest 0, min-max normalised.

Follows kubernetes-sigs/gateway-api-inference-extension
`pkg/epp/scheduling/framework/plugins/scorer/queue.go`: score = (max - q) / (max - min) over the
candidates' `vllm:num_requests_waiting`; all equal -> 1. (kvlab's own `queue` scorer is
1 - q / max: a queue of 10 beside one of 12 scores 0.17 there, 1 here.)"""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer
from kvlab.gateway.scheduler.registry import plugin


@plugin
class QueueScorer(Scorer):
    name = "queue-scorer"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        qs = [float(c.replica.waiting) for c in candidates]
        lo, hi = min(qs, default=0.0), max(qs, default=0.0)
        if hi == lo:
            return [1.0] * len(qs)
        return [(hi - q) / (hi - lo) for q in qs]
