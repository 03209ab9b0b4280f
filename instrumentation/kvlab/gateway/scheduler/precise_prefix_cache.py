"""llm-d's `precise-prefix-cache-scorer`: prefix blocks from the engines' own KV events.

Follows llm-d/llm-d-inference-scheduler `pkg/plugins/scorer/precise_prefix_cache.go` with
llm-d/llm-d-kv-cache-manager's indexer: each pod's score is its run of consecutive cached blocks
from the prompt's start, min-max normalised over the pods that hold any (`utils.go`,
`indexedScoresToNormalizedScoredPods`: all equal -> 1, a pod holding none -> 0). kvlab's precise
index (kvcache/index.py, fed by KV events) gives the blocks; `indexerConfig.tokenProcessorConfig.
blockSize` (default 16) is the block size the index is keyed by until a replica reports its own.
llm-d's earlier `prefix-cache-scorer` with `mode: cache_tracking` (the anchor's config,
llm-d-kv-cache-manager `benchmarking/73-capacity/README.md`) is the same scorer (scheduler/epp.py).
"""

from __future__ import annotations

import random
from typing import Any, Literal, Self

import msgspec

from kvlab.config import Strict, convert
from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer
from kvlab.gateway.scheduler.registry import plugin


class TokenProcessorConfig(Strict, frozen=True, rename="camel"):
    block_size: int = 16
    hash_seed: str = ""


class IndexerConfig(Strict, frozen=True, rename="camel"):
    token_processor_config: TokenProcessorConfig = TokenProcessorConfig()
    kv_block_index_config: dict[str, Any] = msgspec.field(default_factory=dict)   # storage: not modelled


class PreciseParams(Strict, frozen=True, rename="camel"):
    mode: Literal["cache_tracking"] | None = None
    indexer_config: IndexerConfig = IndexerConfig()
    kv_events_config: dict[str, Any] = msgspec.field(default_factory=dict)        # transport: not modelled


@plugin
class PrecisePrefixCacheScorer(Scorer):
    name = "precise-prefix-cache-scorer"
    index_kind = "precise"

    def __init__(self, params: PreciseParams | None = None) -> None:
        self.params = params or PreciseParams()
        self.block_size = self.params.indexer_config.token_processor_config.block_size

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        return cls(convert(parameters, PreciseParams, f"plugin {cls.name} parameters"))

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        blocks = {c.name: c.prefix_tokens // c.replica.block_size if c.replica.block_size else
                  c.prefix_tokens // self.block_size for c in candidates if c.prefix_tokens > 0}
        if not blocks:
            return [0.0] * len(candidates)
        lo, hi = min(blocks.values()), max(blocks.values())
        return [0.0 if c.name not in blocks else 1.0 if hi == lo else (blocks[c.name] - lo) / (hi - lo)
                for c in candidates]
