"""GIE's approximate `prefix-cache-scorer`: the router's own guess of each server's prefix cache.

Follows kubernetes-sigs/gateway-api-inference-extension
`pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go` (and `indexer.go`): the prompt is
cut into blocks of `hashBlockSize` characters (default 64), at most `maxPrefixBlocksToMatch`
(256) of them, each hash chained to the one before and the first to the model; a server's match is
the number of those hashes its LRU holds, counted from the start until a hash no server holds; the
score is match / hashes. After the pick (PreRequest) the chosen server's LRU learns every hash;
each server's LRU keeps `lruCapacityPerServer` hashes (31,250, sized upstream for Llama-3-8B's
~500 k tokens on an H100). Nothing tells it what the server evicted, so an LRU larger than the
server's cache keeps claiming prefixes the server no longer holds (GIE's
`site-src/guides/epp-configuration/prefix-aware.md`): the mechanism of llm-d's approximate run
collapsing under load (docs/twin.md, "Anchors").

kvlab routes token ids, not text: a block is `hashBlockSize / 4` tokens (GIE's own sizing, "a good
guess of average characters per token is 4"). The match in tokens is written to the candidate's
`prefix_tokens`, so a decision's span shows what this index predicted (predicted − delivered).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Annotated, Any, Self

import msgspec

from kvlab.config import Strict, convert
from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer
from kvlab.gateway.scheduler.registry import plugin
from kvlab.kvcache.hashing import block_keys

CHARS_PER_TOKEN = 4
MODEL_BLOCK = hash(("kvlab", "model"))   # upstream's first hash: the target model's name

Positive = Annotated[int, msgspec.Meta(gt=0)]


class PrefixCacheParams(Strict, frozen=True, rename="camel"):
    hash_block_size: Positive = 64
    max_prefix_blocks_to_match: Positive = 256
    lru_capacity_per_server: Positive = 31250


@plugin
class PrefixCacheScorer(Scorer):
    name = "prefix-cache-scorer"
    index_kind = "approximate"

    def __init__(self, params: PrefixCacheParams | None = None) -> None:
        p = params or PrefixCacheParams()
        self.params = p
        self.block_tokens = max(p.hash_block_size // CHARS_PER_TOKEN, 1)
        self.capacity = p.lru_capacity_per_server
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self.holders: dict[int, set[str]] = {}
        self._hashes: list[int] = []   # this scheduling cycle's (upstream's plugin state)

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        return cls(convert(parameters, PrefixCacheParams, f"plugin {cls.name} parameters"))

    def hashes(self, tokens: list[int] | tuple[int, ...] | Any) -> list[int]:
        limit = self.params.max_prefix_blocks_to_match * self.block_tokens
        if len(tokens) < self.block_tokens:
            return []
        return [MODEL_BLOCK, *block_keys(tokens[:limit], self.block_tokens, parent=MODEL_BLOCK)]

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        self._hashes = hashes = self.hashes(req.tokens)
        matched: dict[str, int] = {}
        for h in hashes:
            servers = self.holders.get(h)
            if not servers:
                break
            for s in servers:
                matched[s] = matched.get(s, 0) + 1
        out = []
        for c in candidates:
            m = matched.get(c.name, 0)
            c.prefix_tokens = max(m - 1, 0) * self.block_tokens   # the model's block holds no tokens
            out.append(m / len(hashes) if hashes else 0.0)
        return out

    def chosen(self, req: RouteRequest, chosen: Candidate) -> None:
        name = chosen.name
        lru = self.lru.setdefault(name, OrderedDict())
        for h in self._hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self.holders.setdefault(h, set()).add(name)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            held = self.holders[old]
            held.discard(name)
            if not held:
                del self.holders[old]
