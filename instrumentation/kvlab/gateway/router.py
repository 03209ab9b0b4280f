"""From prompt tokens to a routing decision: block keys per block size, index lookup, scheduler.

Each replica is looked up in the index it can be trusted in: the precise (KV-event) index when
its event stream is live and its tokenizer matches the gateway's, the approximate (learned) index
otherwise. The chosen replica's
blocks are then learned by the approximate index, whatever the policy, so it is ready as a
fallback the moment an event stream goes stale, and, when the replica is on the precise index,
added to its speculative layer: a request sharing the prefix that arrives before the engine's
`BlockStored` then sees it (docs/gateway.md, "Speculative blocks"). A replica whose event stream
is not live yet (a new gateway's feed still connecting or catching up) gets them too: when its
feed goes live before the batches holding those blocks arrive, the precise index must not take
it for empty (lab 10 saw a hot group split over two replicas that way).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvlab.errors import NoEndpointAvailable
from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.endpoints import Backend, Registry
from kvlab.gateway.pull import PullDecision, decide
from kvlab.gateway.scheduler.base import Decision, Ranker, RouteRequest
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
from kvlab.kvcache.intervals import IntervalIndex
from kvlab.kvcache.runkeys import Keys


@dataclass(slots=True)
class Routed:
    decision: Decision
    keys_by_size: dict[int, Keys]
    index_of: dict[str, str]          # replica -> "precise" | "approximate"
    keys_s: float                     # hashing time
    total_s: float                    # hashing + lookup + scoring
    cpu: dict[str, int]               # replica -> prefix tokens held only in its CPU tier (docs/tiered.md)
    pull: PullDecision | None = None  # holder vs pull vs recompute, when a busy holder was passed over
    lookup_ns: tuple[int, int] = (0, 0)   # the index lookup's start and end (Unix ns): its span's times


class Router:
    def __init__(self, cfg: PolicyConfig, registry: Registry, precise: PreciseIndex | IntervalIndex,
                 approx: ApproximateIndex, ranker: Ranker, fallback: bool = True) -> None:
        self.cfg = cfg
        # False where event streams never go stale (the twin): the approximate index then learns
        # only what it is read for, the replicas not on the precise one
        self.fallback = fallback
        self.registry = registry
        self.precise = precise
        self.approx = approx
        self.ranker = ranker

    def block_size(self, r: Backend) -> int:
        return r.block_size or self.precise.block_size.get(r.name) or self.cfg.index.default_block_size

    def precise_keys(self, r: Backend) -> bool:
        """The policy's index is precise and `r`'s block keys are ours (its events' keys would never
        match ours under a tokenizer mismatch): its routed blocks can be speculative there."""
        return self.cfg.index.kind == "precise" and r.tokenizer != "tokenizer-mismatch"

    def uses_precise(self, r: Backend) -> bool:
        return self.precise_keys(r) and r.events_state == "live"

    def route(self, tokens: Sequence[int], exclude: frozenset[str] = frozenset(),
              keys: Mapping[int, Keys] | None = None) -> Routed:
        """Route a prompt. `keys`: its block keys by block size where the caller has them already
        (the twin keys a trace's prompts by their structure, twin/keys.py); the others are hashed."""
        t0 = time.perf_counter()
        replicas = [r for r in self.registry.candidates(include_prefill=not self.cfg.pd.enabled)
                    if r.name not in exclude]
        if not replicas:
            raise NoEndpointAvailable("no healthy replica to route to")
        sizes = {r.name: self.block_size(r) for r in replicas}
        keys_by_size = {bs: keys[bs] if keys and bs in keys else block_keys(tokens, bs) for bs in set(sizes.values())}
        t1, lookup = time.perf_counter(), time.time_ns()
        prefix, speculative, index_of = self.prefix_of(replicas, keys_by_size, len(tokens), sizes)
        cpu = self.cpu_only(replicas, keys_by_size, prefix, sizes, index_of)
        looked_up = time.time_ns()
        decision = self.ranker.schedule(RouteRequest(len(tokens), tokens), replicas, prefix, speculative, cpu)
        pull = self.pull(decision, len(tokens))
        self.learn(decision.chosen.replica, keys_by_size, sizes)
        return Routed(decision, keys_by_size, index_of, t1 - t0, time.perf_counter() - t0, cpu, pull,
                      (lookup, looked_up))

    def cpu_only(self, replicas: list[Backend], keys_by_size: dict[int, Keys], prefix: dict[str, int],
                 sizes: dict[str, int], index_of: dict[str, str]) -> dict[str, int]:
        """Of each precise replica's prefix, the tokens held only in its CPU tier (empty unless the
        policy weighs that tier and some replica reported one)."""
        if self.cfg.index.tiers.cpu <= 0 or not self.precise.offloads:
            return {}
        precise = {r.name: sizes[r.name] for r in replicas if index_of.get(r.name) == "precise"}
        gpu = self.precise.match(keys_by_size, precise)
        return {name: max(prefix[name] - min(gpu[name], prefix[name]), 0) for name in precise}

    def pull(self, d: Decision, prompt_tokens: int) -> PullDecision | None:
        """With `pull.enabled`, when the longest prefix is on another replica than the chosen one:
        send the request to the holder instead, or keep the choice with a pull hint, or recompute
        (gateway/pull.py), whichever is estimated fastest."""
        s = self.cfg.pull
        holder = max(d.candidates, key=lambda c: c.prefix_tokens)
        if not s.enabled or d.shadow or holder.name == d.chosen.name:
            return None
        p = decide(prompt_tokens, holder.replica, holder.prefix_tokens, d.chosen.replica, d.chosen.prefix_tokens, s)
        if p is not None and p.choice == "holder":
            d.ranked.remove(holder)
            d.ranked.insert(0, holder)
            d.chosen = holder
        return p

    def prefix_of(self, replicas: list[Backend], keys_by_size: dict[int, Keys], n_tokens: int,
                  sizes: dict[str, int] | None = None) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
        """Reusable cached prefix tokens per replica, each looked up in the index it can be trusted
        in; how many of them are only speculative (precise index, not yet confirmed); and which
        index that was. `keys_by_size` must hold every replica's block size.

        An engine always computes a prompt's last token (it needs its logits), so a fully cached,
        block-aligned prompt reuses one block less than it holds: the match is capped at the full
        blocks of `n_tokens - 1` tokens, which is what vLLM then reports as `cached_tokens`."""
        sizes = sizes or {r.name: self.block_size(r) for r in replicas}
        precise_sizes = {r.name: sizes[r.name] for r in replicas if self.uses_precise(r)}
        approx_sizes = {n: bs for n, bs in sizes.items() if n not in precise_sizes}
        cpu = self.cfg.index.tiers.cpu > 0     # CPU-tier blocks count as held (scored lower: docs/tiered.md)
        prefix = self.precise.match(keys_by_size, precise_sizes, offloaded=cpu) if precise_sizes else {}
        # the confirmed part, looked up only where it can differ: a matched prefix on a replica
        # holding speculative blocks (at 128 replicas most hold no prefix of a given prompt)
        unsure = {n: bs for n, bs in precise_sizes.items()
                  if prefix[n] and self.precise.speculative_blocks(n, expire=False)}
        confirmed = self.precise.match(keys_by_size, unsure, speculative=False, offloaded=cpu) if unsure else {}
        if approx_sizes:
            prefix.update(self.approx.match(keys_by_size, approx_sizes))
        speculative = dict.fromkeys(prefix, 0)
        for name, tokens in prefix.items():
            if tokens:
                bs = sizes[name]
                prefix[name] = capped = min(tokens, max(n_tokens - 1, 0) // bs * bs)
                speculative[name] = max(capped - confirmed.get(name, capped), 0)
        return prefix, speculative, {n: ("precise" if n in precise_sizes else "approximate") for n in sizes}

    def learn(self, r: Backend, keys_by_size: dict[int, Keys], sizes: dict[str, int] | None = None) -> None:
        """`r` was sent a prompt with these keys: the approximate index learns them and, when the
        policy's index is precise (whether or not `r`'s feed is live yet) and `r`'s tokenizer is the
        gateway's, they are speculative there until its engine confirms them."""
        bs = sizes[r.name] if sizes and r.name in sizes else self.block_size(r)
        keys = keys_by_size.get(bs)
        if keys is None:
            return
        if r.num_gpu_blocks:
            self.approx.capacity_of[r.name] = r.num_gpu_blocks
        if self.fallback or not self.uses_precise(r):
            self.approx.learn(r.name, keys, bs)
        if self.precise_keys(r):
            self.precise.speculate(r.name, keys)
