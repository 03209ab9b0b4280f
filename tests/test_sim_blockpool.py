"""Unit tests of the simulator's block pool, scheduler and latency model (no I/O)."""

from __future__ import annotations

import gc
import random
from collections import OrderedDict
from itertools import takewhile

import pytest

from kvlab.config import convert
from kvlab.engine.sim import freequeue
from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.profile import LatencyProfile, load_profiles
from kvlab.engine.sim.scheduler import FINISHED, Request, Scheduler
from kvlab.errors import ConfigError
from kvlab.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.kvcache.hashing import block_keys


def _keys(n: int, start: int = 0) -> list[int]:
    return block_keys(list(range(start, start + 4 * n)), 4, seed=7)


# ---- block pool --------------------------------------------------------------------------
def test_a_pools_blocks_start_at_most_one_collection_and_the_collector_is_left_as_it_was():
    """A pool's blocks hold no cycles: made with the collector paused, 28,000 of them start at most
    one collection, once it is back (the interpreter's threshold would start one every 700: 40);
    it is enabled again only if it was."""
    runs: list[str] = []

    def count(phase: str, info: dict) -> None:
        runs.append(phase)
    gc.collect()
    gc.callbacks.append(count)
    try:
        assert len(BlockPool(28_000, 16, events=False).blocks) == 28_000
    finally:
        gc.callbacks.remove(count)
    assert runs.count("start") <= 1 and gc.isenabled()
    gc.disable()
    try:
        BlockPool(8, 4)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_cached_blocks_are_found_by_prefix_and_stored_events_carry_tokens():
    pool = BlockPool(8, 4)
    blocks = pool.allocate(3)
    keys = _keys(3)
    tokens = list(range(12))
    pool.cache(blocks, keys, None, tokens)
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == keys and ev.token_ids == tokens
    assert ev.parent_block_hash is None and ev.block_size == 4
    assert all(0 <= h < 2**64 for h in ev.block_hashes)
    assert pool.cached_prefix(keys) == blocks
    assert pool.cached_prefix([keys[0], 12345, keys[2]]) == blocks[:1]   # a prefix, not a subset
    assert pool.cached_prefix([999]) == []


def test_blocks_in_use_are_never_evicted():
    pool = BlockPool(4, 4)
    held = pool.allocate(2)
    pool.cache(held, _keys(2), None, list(range(8)))
    other = pool.allocate(2)
    assert pool.num_free == 0
    assert pool.allocate(1) is None          # nothing free: held cached blocks stay
    assert pool.cached_prefix(_keys(2)) == held
    pool.free(reversed(other))
    assert pool.allocate(2) is not None
    assert pool.cached_prefix(_keys(2)) == held


def test_lru_eviction_of_free_cached_blocks_emits_block_removed():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    ka = _keys(2, start=0)
    pool.cache(a, ka, None, list(range(8)))
    b = pool.allocate(2)
    kb = _keys(2, start=100)
    pool.cache(b, kb, None, list(range(100, 108)))
    pool.free(reversed(a))   # a freed first: least recently used
    pool.free(reversed(b))
    pool.take_events()
    new = pool.allocate(2)
    assert new is not None
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockRemoved)
    # vLLM frees a request's blocks tail first, so its last block goes before its first one
    assert ev.block_hashes == [ka[1], ka[0]]
    assert pool.cached_prefix(ka) == [] and pool.cached_prefix(kb) == b


def test_touch_takes_reuse_out_of_the_free_queue_and_refcounts():
    pool = BlockPool(3, 4)
    a = pool.allocate(1)
    pool.cache(a, _keys(1), None, [0, 1, 2, 3])
    pool.free(a)
    hit = pool.cached_prefix(_keys(1))
    pool.touch(hit)          # request 1 reuses it
    pool.touch(hit)          # request 2 too
    assert hit[0].ref_cnt == 2 and pool.num_free == 2
    pool.free(hit)
    assert pool.num_free == 2  # still used by request 2
    assert pool.allocate(2) is not None and pool.allocate(1) is None
    pool.free(hit)
    assert pool.num_free == 1


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3, 4)
    blocks = pool.allocate(3)
    pool.cache(blocks[:1], _keys(1), None, [0, 1, 2, 3])
    pool.free(blocks)         # cached one first (LRU), then two uncached ones
    pool.take_events()
    pool.allocate(2)
    assert pool.take_events() == []   # the cached block survived
    assert pool.cached_prefix(_keys(1)) == blocks[:1]


def test_duplicate_content_is_cached_once_and_reset_clears_everything():
    pool = BlockPool(4, 4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache(a, _keys(1), None, [0, 1, 2, 3])
    pool.cache(b, _keys(1), None, [0, 1, 2, 3])
    assert len(pool.take_events()) == 1 and pool.num_cached == 1
    pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_cached == 0 and pool.cached_prefix(_keys(1)) == []


class _LruByHand:
    """The pool's eviction order kept one block at a time in an OrderedDict, as vLLM's free list
    keeps it: freed blocks to the back, uncached ones to the front, reused ones taken out."""

    def __init__(self, n: int) -> None:
        self.ref, self.key = [0] * n, [None] * n
        self.cached: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))

    def hit(self, keys: list[int]) -> list[int]:
        ids = list(takewhile(lambda i: i is not None, map(self.cached.get, keys)))
        for i in ids:
            if self.ref[i] == 0:
                del self.free[i]
            self.ref[i] += 1
        return ids

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = [self.free.popitem(last=False)[0] for _ in range(n)]
        for i in out:
            if self.key[i] is not None:
                del self.cached[self.key[i]]
                self.key[i] = None
            self.ref[i] = 1
        return out

    def cache(self, ids: list[int], keys: list[int]) -> None:
        for i, k in zip(ids, keys):
            if k not in self.cached:
                self.cached[k], self.key[i] = i, k

    def release(self, ids: list[int]) -> None:
        for i in reversed(ids):
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self.free[i] = None
                if self.key[i] is None:
                    self.free.move_to_end(i, last=False)

    def reset(self) -> None:
        for i in self.cached.values():
            self.key[i] = None
        self.cached.clear()


@pytest.mark.parametrize(("seed", "spare"), [(0, 1024), (1, 1024), (2, 8), (3, 8)])
def test_free_queue_evicts_in_the_order_of_an_lru_kept_block_by_block(seed, spare, monkeypatch):
    """The pool's free queue (a list read from its head, reused blocks skipped, freequeue.py)
    evicts exactly as an OrderedDict LRU would, through hits, partial blocks, resets, blocks freed in
    any order, and the hit-only stretches after which it keeps only its live entries (sooner with a
    small `spare`)."""
    monkeypatch.setattr(freequeue, "_SPARE", spare)
    rng = random.Random(seed)
    pool, ref = BlockPool(48, 4, events=False), _LruByHand(48)
    held: list[list] = []   # each running request's blocks
    for step in range(8000):
        if held and (rng.random() < 0.45 or len(held) > 6):
            blocks = held.pop(rng.randrange(len(held)))
            order = list(reversed(blocks))
            if rng.random() < 0.3:   # any order: uncached and still shared blocks anywhere in it
                rng.shuffle(order)
            pool.free(order)
            ref.release([b.id for b in reversed(order)])
        elif step % 2500 == 2499:
            pool.reset()
            ref.reset()
        else:
            hot = step % 2000 < 1200   # a stretch of the same few prompts: hits, no allocation
            family, n = (rng.randrange(2), 3) if hot else (rng.randrange(12), rng.randrange(1, 10))
            keys = [family * 100 + j for j in range(n)]
            hits = pool.cached_prefix(keys)
            pool.touch(hits)
            assert [b.id for b in hits] == ref.hit(keys)
            new = pool.allocate(n - len(hits))
            want = ref.allocate(n - len(hits))
            assert (new is None) == (want is None) and [b.id for b in new or []] == (want or [])
            if new is None:
                pool.free(reversed(hits))
                ref.release([b.id for b in hits])
                continue
            full = n - len(hits) - (0 if hot else rng.randrange(2))   # the last block sometimes partial
            pool.cache(new[:full], keys[len(hits):len(hits) + full], None, [])
            ref.cache([b.id for b in new[:full]], keys[len(hits):len(hits) + full])
            held.append(hits + new)
        assert pool.num_free == len(ref.free)


# ---- scheduler ---------------------------------------------------------------------------
def _sched(num_blocks=64, bs=4, max_seqs=8, budget=64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, bs), max_seqs, budget, hash_seed=3)


def _req(s: Scheduler, prompt: list[int], n_out: int = 3, rid: str = "r") -> Request:
    return Request(rid, prompt, [1000 + i for i in range(n_out)], s.prompt_keys(prompt))


def _run(s: Scheduler, limit: int = 1000) -> list:
    steps = []
    for _ in range(limit):
        if not s.has_work():
            break
        b = s.schedule()
        steps.append((b.prefill_tokens, b.decode_seqs))
        s.complete(b)
    return steps


def test_prefill_then_one_token_per_decode_step_then_blocks_freed():
    s = _sched()
    r = _req(s, list(range(10)), n_out=3)
    s.add(r)
    assert _run(s) == [(10, 0), (0, 1), (0, 1)]
    assert r.status == FINISHED and r.finish_reason == "length" and r.num_output == 3
    assert s.pool.num_free == s.pool.num_blocks
    # prompt blocks (2 full) and the output-filled third block (10 prompt + 2 computed outputs = 12)
    assert s.pool.num_cached == 3


def test_repeated_prompt_hits_cache_except_the_last_token():
    s = _sched()
    prompt = list(range(16))
    s.add(_req(s, prompt))
    _run(s)
    r2 = _req(s, prompt, rid="r2")
    s.add(r2)
    steps = _run(s)
    # 16 tokens = 4 full blocks; the last block is recomputed so one token is left to sample from
    assert r2.num_cached == 12 and steps[0] == (4, 0)
    assert s.prefix_queries == 32 and s.prefix_hits == 12



def test_without_token_ids_the_same_blocks_are_stored_and_the_events_carry_no_ids():
    """The twin's engines skip the ids (its index reads keys only): the same steps and the same
    stored keys, chained alike, with no ids."""
    runs = []
    for ids in (True, False):
        s = Scheduler(BlockPool(64, 4), 8, 6, hash_seed=3, token_ids=ids)
        for i, prompt in enumerate((list(range(10)), list(range(13)))):
            s.add(_req(s, prompt, n_out=6, rid=f"r{i}"))
        steps = _run(s)
        runs.append((steps, [e for e in s.pool.take_events() if isinstance(e, BlockStored)]))
    (steps, stored), (steps_bare, stored_bare) = runs
    assert steps == steps_bare and len(stored) >= 3
    assert [(e.block_hashes, e.parent_block_hash) for e in stored] == \
        [(e.block_hashes, e.parent_block_hash) for e in stored_bare]
    assert all(e.token_ids for e in stored) and not any(e.token_ids for e in stored_bare)

def test_chunked_prefill_respects_the_token_budget_and_decodes_ride_along():
    s2 = _sched(budget=8)
    a = _req(s2, list(range(4)), n_out=5, rid="a")
    b = _req(s2, list(range(100, 120)), n_out=1, rid="b")
    s2.add(a)
    s2.complete(s2.schedule())     # a prefilled (4 tokens)
    s2.add(b)
    steps = _run(s2)
    # a decodes 1/step, b's 20-token prompt goes in chunks of the remaining 7 tokens
    assert steps[:3] == [(7, 1), (7, 1), (6, 1)]
    assert b.num_output == 1 and b.status == FINISHED


def test_max_num_seqs_keeps_requests_waiting():
    s = _sched(max_seqs=2)
    rs = [_req(s, [i * 10 + j for j in range(5)], rid=str(i)) for i in range(3)]
    for r in rs:
        s.add(r)
    b = s.schedule()
    assert [r.id for r in b.requests] == ["0", "1"] and len(s.waiting) == 1


def test_out_of_blocks_preempts_the_newest_and_it_completes_later():
    s = _sched(num_blocks=6, bs=4, budget=64)
    a = _req(s, list(range(12)), n_out=8, rid="a")   # grows to 5 blocks
    b = _req(s, list(range(50, 58)), n_out=8, rid="b")
    s.add(a)
    s.add(b)
    _run(s)
    assert s.preemptions >= 1
    assert a.status == b.status == FINISHED and a.num_output == b.num_output == 8
    assert s.pool.num_free == 6


def test_abort_frees_blocks():
    s = _sched()
    r = _req(s, list(range(10)))
    s.add(r)
    s.complete(s.schedule())
    assert s.pool.num_free < s.pool.num_blocks
    s.abort(r)
    assert r.status == FINISHED and r.finish_reason == "abort" and s.pool.num_free == s.pool.num_blocks


# ---- latency model -----------------------------------------------------------------------
def test_step_time_saves_in_proportion_to_tokens_not_recomputed():
    p = load_profiles()["cpu-tiny"]
    cold, warm = p.step_ms(2000, 0), p.step_ms(16, 0)
    assert cold - warm == pytest.approx(1984 * p.prefill_ms_per_token)
    assert p.step_ms(0, 8) > p.step_ms(0, 1) > p.step_ms(0, 0)


def test_every_shipped_profile_is_valid_and_unknown_keys_are_errors():
    profiles = load_profiles()
    assert {"cpu-tiny"} < set(profiles) and len(profiles) >= 2
    for p in profiles.values():
        assert p.source and p.max_model_len <= p.num_blocks * p.block_size
    with pytest.raises(ConfigError, match="prefil_ms_per_token"):
        convert({"description": "x", "source": "y", "step_overhead_ms": 1, "prefil_ms_per_token": 1,
                 "decode_ms_base": 1, "decode_ms_per_seq": 1}, LatencyProfile)
