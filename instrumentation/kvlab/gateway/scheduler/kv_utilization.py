"""GIE's `kv-cache-utilization-scorer` (earlier `kv-cache-scorer`): 1 - the pod's KV-cache usage.

Follows kubernetes-sigs/gateway-api-inference-extension
`pkg/epp/scheduling/framework/plugins/scorer/kvcache_utilization.go`: score = 1 - KVCacheUsagePercent
(`vllm:kv_cache_usage_perc`, scraped), no normalisation across pods."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer
from kvlab.gateway.scheduler.registry import plugin


@plugin
class KvCacheUtilizationScorer(Scorer):
    name = "kv-cache-utilization-scorer"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return [min(max(1.0 - c.replica.kv_usage, 0.0), 1.0) for c in candidates]
