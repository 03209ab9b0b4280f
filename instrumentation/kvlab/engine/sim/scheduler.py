"""Continuous batching, as vLLM v1 schedules: one token budget per step, chunked prefill.

Pure bookkeeping in virtual time (no clock, no I/O), so the engine loop drives it in real time and
benchmarks replay it offline. Every request has `num_tokens` (prompt + sampled output) and
`num_computed` (tokens whose KV exists); a step computes up to `num_tokens - num_computed` of them
per request within the budget, running requests first, then waiting ones in arrival order.
A request whose KV becomes complete samples one token. Out of blocks, the newest running request
is preempted (blocks freed, recomputed later, as vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from kvlab.engine.sim.blockpool import Block, BlockPool
from kvlab.engine.sim.retention import NORMAL, RetentionDirective, block_classes
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.runkeys import Keys, RunKeys

if TYPE_CHECKING:
    import asyncio

WAITING, RUNNING, FINISHED = 0, 1, 2


class Request:
    """One generation request: its tokens, KV blocks and progress (times are set by the engine)."""

    __slots__ = (
        "blocks",
        "ctx",
        "finish_reason",
        "id",
        "keys",
        "max_tokens",
        "min_tokens",
        "num_cached",
        "num_computed",
        "num_loaded",
        "num_output",
        "num_prompt",
        "num_tokens",
        "output",
        "prompt",
        "retention",
        "scheduled",
        "status",
        "stop",
        "t_arrival",
        "t_finished",
        "t_first_token",
        "t_last_token",
        "t_scheduled",
        "text_len",
        "waiter",
    )

    def __init__(self, request_id: str, prompt: Sequence[int], output: list[int], keys: Keys,
                 stop: Sequence[str] = (), min_tokens: int = 0,
                 retention: list[RetentionDirective] | None = None) -> None:
        self.id = request_id
        self.retention = retention        # retention directives (retention.py), None: untyped
        self.prompt = prompt
        self.output = output              # the ids it will emit, drawn in advance (deterministic)
        self.max_tokens = len(output)
        self.num_prompt = len(prompt)
        self.num_tokens = len(prompt)
        self.num_computed = 0
        self.num_output = 0
        self.num_cached: int | None = None   # prefix-cache hit (tokens) at first scheduling
        self.num_loaded = 0               # of which loaded from the CPU tier (tier.py)
        self.keys = keys                  # chained keys of its full blocks known so far
        self.blocks: list[Block] = []
        self.status = WAITING
        self.finish_reason: str | None = None
        self.scheduled = 0                # tokens scheduled in the current step
        self.stop = stop
        self.min_tokens = min_tokens
        self.text_len = 0                 # characters of output text to deliver (stop strings cut it)
        self.t_arrival = self.t_scheduled = self.t_first_token = self.t_last_token = self.t_finished = 0
        self.waiter: asyncio.Future[None] | None = None   # the engine's wake-up future for the response writer
        self.ctx = None                   # the engine's tracing context

    def token(self, i: int) -> int:
        return self.prompt[i] if i < self.num_prompt else self.output[i - self.num_prompt]

    def tokens(self, start: int, end: int) -> list[int]:
        # a prompt's slice is a list: a list's, or a twin trace prompt's (twin/feed.py `TraceTokens`)
        n = self.num_prompt
        if end <= n:
            return cast(list[int], self.prompt[start:end])
        if start >= n:   # an output block: no copy of the whole prompt
            return self.output[start - n:end - n]
        return cast(list[int], self.prompt[start:]) + self.output[:end - n]


@dataclass(slots=True)
class Batch:
    """One step's work: requests with `scheduled` tokens each."""

    requests: list[Request] = field(default_factory=list)
    prefill_tokens: int = 0
    prefill_ctx_k: float = 0.0      # sum of the prefill tokens' positions / 1000 (the attention term)
    decode_seqs: int = 0
    admitted: list[Request] = field(default_factory=list)   # first scheduled in this step
    preempted: int = 0
    loaded_blocks: int = 0          # blocks loaded from the CPU tier for this step (tier.py)


def _positions_k(start: int, n: int) -> float:
    """Sum of the positions start .. start+n-1, in thousands."""
    return n * (2 * start + n - 1) / 2000


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 hash_seed: int = 1, token_ids: bool = True) -> None:
        self.pool = pool
        # the KV events carry the blocks' token ids (vLLM's do); the twin's index reads only the
        # engines' keys (PreciseIndex `engine_keys`), so its engines skip copying them
        self.token_ids = token_ids
        # an answer's blocks are keyed by hashing its tokens on from the prompt's (vLLM's are);
        # set, the first key of a request's answer blocks, the rest consecutive (twin/keys.py)
        self.answer_keys: Callable[[Request], int] | None = None
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.hash_seed = hash_seed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_queries = 0            # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0               # of which found cached
        self.preemptions = 0
        self.external_hits = 0             # of the queried tokens, found in the CPU tier (tier.py)

    def prompt_keys(self, prompt: list[int]) -> list[int]:
        """The engine's block keys of a prompt (its own hash family, like vLLM's seeded hash)."""
        return block_keys(prompt, self.block_size, seed=self.hash_seed)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        """Drop a request (client went away); frees its blocks."""
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._finish(req, "abort")

    def reset_prefix_cache(self) -> None:
        self.pool.reset()

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_num_batched_tokens
        pool, bs = self.pool, self.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            need = -(-(req.num_computed + n) // bs) - len(req.blocks)
            if need > 0:
                new = pool.allocate(need)
                while new is None:
                    victim = self.running[-1]
                    self._preempt(victim, batch)
                    if victim is req:
                        break
                    new = pool.allocate(need)
                if new is None:
                    break
                req.blocks.extend(new)
            self._add_to_batch(batch, req, n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            req = self.waiting[0]
            hits: list[Block] = []
            loaded = 0
            if req.num_computed == 0 and not req.blocks:
                cap = (req.num_tokens - 1) // bs
                hits = pool.cached_prefix(req.keys[:cap])
                if pool.tier is not None:   # the GPU miss continues in CPU memory (tier.py)
                    loaded = pool.tier.lookup(req.keys[len(hits):cap])
            computed = (len(hits) + loaded) * bs
            n = min(req.num_tokens - computed, budget)
            need = -(-(computed + n) // bs) - len(hits)
            pool.touch(hits)
            new = pool.allocate(need)
            if new is None:
                pool.free(reversed(hits))
                break
            self.waiting.popleft()
            req.blocks = hits + new
            req.num_computed = computed
            if loaded:
                self._load(batch, req, len(hits), loaded)
            if req.num_cached is None:
                req.num_cached = computed
                req.num_loaded = loaded * bs
                if pool.typed is not None:
                    self._count_typed_hits(req, len(hits), cap)
                self.prefix_queries += req.num_tokens
                self.prefix_hits += len(hits) * bs
                self.external_hits += loaded * bs
                batch.admitted.append(req)
            req.status = RUNNING
            self.running.append(req)
            self._add_to_batch(batch, req, n)
            budget -= n
        return batch

    def _load(self, batch: Batch, req: Request, start: int, n: int) -> None:
        """Blocks start..start+n of `req` come from the CPU tier: cached on GPU again (BlockStored
        GPU, as vLLM caches loaded blocks), their load paid in this step."""
        pool, bs, keys = self.pool, self.block_size, req.keys
        assert pool.tier is not None
        pool.tier.load(keys[start:start + n])
        pool.cache(req.blocks[start:start + n], keys[start:start + n], keys[start - 1] if start else None,
                   req.tokens(start * bs, (start + n) * bs) if self.token_ids else [])
        batch.loaded_blocks += n

    def _count_typed_hits(self, req: Request, n_hits: int, cap: int) -> None:
        """Per-class block lookups and hits of a prompt; hits take the request's classes."""
        typed = self.pool.typed
        assert typed is not None
        classes = self._classes(req, 0, cap)
        for i, cls in enumerate(classes):
            typed.stats.queries[cls] += 1
            if i < n_hits:
                typed.stats.hits[cls] += 1
        if req.retention is not None:
            self.pool.classify(req.blocks[:n_hits], classes)

    def _classes(self, req: Request, start: int, end: int) -> list[int]:
        directives = req.retention or []
        return block_classes(directives, end, self.block_size)[start:]

    def _add_to_batch(self, batch: Batch, req: Request, n: int) -> None:
        req.scheduled = n
        batch.requests.append(req)
        if n == 1 and req.num_output > 0 and req.num_computed == req.num_tokens - 1:
            batch.decode_seqs += 1
        else:
            batch.prefill_tokens += n
            batch.prefill_ctx_k += _positions_k(req.num_computed, n)

    def _preempt(self, req: Request, batch: Batch) -> None:
        self.running.remove(req)
        if req in batch.requests:
            batch.requests.remove(req)
            if req.scheduled == 1 and req.num_output > 0:
                batch.decode_seqs -= 1
            else:
                batch.prefill_tokens -= req.scheduled
                batch.prefill_ctx_k -= _positions_k(req.num_computed, req.scheduled)
        if self.pool.typed is not None:   # it resumes soon: its own evict-first blocks must survive till then
            self.pool.classify(req.blocks, [max(b.cls, NORMAL) for b in req.blocks])
        self.pool.free(reversed(req.blocks))
        req.blocks = []
        req.num_computed = 0
        req.status = WAITING
        self.waiting.appendleft(req)
        self.preemptions += 1
        batch.preempted += 1

    def complete(self, batch: Batch) -> list[Request]:
        """Apply a finished step: KV computed, full blocks cached, one token sampled by each
        request whose KV is complete. Returns those requests (finished ones included)."""
        sampled: list[Request] = []
        bs = self.block_size
        for req in batch.requests:
            if req.status != RUNNING:
                continue
            before = req.num_computed // bs
            req.num_computed += req.scheduled
            req.scheduled = 0
            after = req.num_computed // bs
            if after > before:
                self._cache_blocks(req, before, after)
            if req.num_computed == req.num_tokens:
                req.num_output += 1
                req.num_tokens += 1
                sampled.append(req)
                if req.num_output >= req.max_tokens:
                    self.finish(req, "length")
        return sampled

    def _cache_blocks(self, req: Request, start: int, end: int) -> None:
        bs = self.block_size
        keys = req.keys
        if len(keys) < end:  # output blocks: extend the chain over generated tokens
            first = len(keys)
            if self.answer_keys is not None:   # a run of keys, from the answer's first on
                keys = cast(RunKeys, keys)   # (a trace prompt's, twin/keys.py)
                at = keys.runs[-1][1] if first > req.num_prompt // bs else self.answer_keys(req)
                keys.add(at, at + end - first)
            else:
                if not isinstance(keys, list):   # a twin trace prompt's, as runs: a list once an
                    req.keys = keys = list(keys)   # answer's hashed keys extend them (kvcache/runkeys.py)
                parent = keys[-1] if keys else 0
                keys.extend(block_keys(req.tokens(first * bs, end * bs), bs, parent=parent, seed=self.hash_seed))
        # skip blocks that came from the cache already (they are cached under these keys)
        blocks = req.blocks
        while start < end:
            key = blocks[start].key
            if key is None or key != keys[start]:   # (a fresh block's key is None: no key read)
                break
            start += 1
        if start < end:
            classes = self._classes(req, start, end) if self.pool.typed is not None else None
            self.pool.cache(req.blocks[start:end], keys[start:end], keys[start - 1] if start else None,
                            req.tokens(start * bs, end * bs) if self.token_ids else [], classes)

    def finish(self, req: Request, reason: str) -> None:
        """End a running request now (length, stop): frees its blocks."""
        if req.status == RUNNING:
            self.running.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        if req.status == FINISHED:
            return
        req.status = FINISHED
        req.finish_reason = reason
        self.pool.free(reversed(req.blocks))
        req.blocks = []
