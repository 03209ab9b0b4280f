"""vllm-router's `cache_aware` policy as a picker, so the twin and the gateway can run it.

It follows vllm-router 0.1.17 (vllm-project/router, src/policies/cache_aware.rs and src/tree.rs;
defaults from `vllm-router --help`). Load is each worker's requests in flight through the router.
When the load is imbalanced, (max - min) > balance_abs_threshold and max > min x
balance_rel_threshold, the least-loaded worker takes the request (the first in worker order on a
tie). Otherwise the router looks the prompt up in its approximate tree, learned from its own
routing decisions: the longest match over all workers, as a share of the prompt; above
cache_threshold the request goes to a worker holding that match, else to the least-loaded worker.
Either way the chosen worker learns the prompt.

vllm-router 0.1.17 keeps its tree over the token ids each worker's `/v1/chat/completions/render`
returns (without that endpoint it routes by load alone); the approximate index (`index: {kind:
approximate}`) stands for it: the same ids learned from the same decisions, in KV blocks, so the
match rate is cached tokens / prompt tokens rounded down to a block. Where several workers hold the
longest match, vllm-router takes the one that last touched that node of its tree; here a seeded
draw among them. Its tree is bounded at 33,554,432 entries per worker, evicted every 120 s; the
approximate index at each replica's KV blocks, LRU. tests/test_cache_aware_fidelity.py holds the
two to the same decisions.
"""

from __future__ import annotations

import random
from typing import Self

from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.scheduler.base import Candidate, Picker
from kvlab.gateway.scheduler.registry import plugin


@plugin
class CacheAware(Picker):
    name = "cache-aware"

    def __init__(self, rng: random.Random | None = None, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5) -> None:
        super().__init__(rng)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold

    @classmethod
    def from_policy(cls, cfg: PolicyConfig, rng: random.Random) -> Self:
        c = cfg.cache_aware
        return cls(rng, c.cache_threshold, c.balance_abs_threshold, c.balance_rel_threshold)

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        loads = [c.replica.inflight for c in candidates]
        least = min(range(len(candidates)), key=lambda i: loads[i])   # the first on a tie, as min_by_key
        hi, lo = max(loads), min(loads)
        choice = least
        if not (hi - lo > self.balance_abs and hi > lo * self.balance_rel):
            rate = max(c.scores.get("prefix", 0.0) for c in candidates)
            if rate > self.cache_threshold:
                holders = [i for i, c in enumerate(candidates) if c.scores.get("prefix", 0.0) == rate]
                choice = holders[0] if len(holders) == 1 else self.rng.choice(holders)
        return [candidates[choice]] + [c for i, c in enumerate(candidates) if i != choice]
