"""KV-utilisation scorer: free KV cache (1 - `vllm:kv_cache_usage_perc`) is better; a full cache
means evictions (lost prefixes) and preemptions."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer
from kvlab.gateway.scheduler.registry import plugin


@plugin
class KvUsageScorer(Scorer):
    name = "kv_usage"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return [min(max(1.0 - c.replica.kv_usage, 0.0), 1.0) for c in candidates]
