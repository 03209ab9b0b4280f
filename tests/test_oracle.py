"""The oracle hit rate: Belady on one pooled cache of the total capacity, a ceiling for routing.

A hand-made workload whose ceiling is worked out by hand; a brute-force check that no routing of
small random workloads over LRU replicas (with prefix hits, as engines count them) beats it."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

from kvlab.load.oracle import Oracle, Prompt, ceiling, oracle
from kvlab.load.workloads import create

BS = 4
A, B, C, D, E = 1, 2, 3, 4, 5   # block keys (a chained hash would make them distinct per prefix)


def hand_made() -> list[Prompt]:
    # 13-token prompts hold 3 full blocks; the 5-token one holds 1
    return [Prompt(13, [A, B, C]), Prompt(13, [A, B, D]), Prompt(5, [E]), Prompt(13, [A, B, C])]


def test_hand_made_ceiling():
    reqs = hand_made()
    # unbounded: request 2 reuses a, b; request 4 reuses a, b, c -> 5 blocks of 4 tokens
    assert ceiling(reqs, BS, None) == Oracle(44, 20, BS, None)
    # 3 blocks: keep a, b, c; d and e are never used again, so they are not kept -> the same 5 blocks
    assert ceiling(reqs, BS, 3).hit_tokens == 20
    # 2 blocks: keep a, b (c's next use is farther than theirs, so c is not kept) -> a, b twice = 4 blocks;
    # pooled LRU would hit nothing here (c, then a, b, d, e each push out what request 4 needs)
    o = ceiling(reqs, BS, 2)
    assert o.hit_tokens == 16 and o.hit_rate == 16 / 44
    assert ceiling(reqs, BS, 0).hit_tokens == 0


def lru_routing_hits(reqs: list[Prompt], route: tuple[int, ...], replicas: int, cap: int) -> int:
    """Prefix hits (tokens) of a given routing over replicas running LRU, as an engine counts them."""
    caches = [OrderedDict() for _ in range(replicas)]
    hits = 0
    for p, r in zip(reqs, route):
        cache = caches[r]
        n = 0
        while n < len(p.keys) and p.keys[n] in cache:
            n += 1
        hits += n * BS
        for k in p.keys:
            cache[k] = None
            cache.move_to_end(k)
            if len(cache) > cap:
                cache.popitem(last=False)
    return hits


def test_no_routing_beats_the_ceiling():
    rng = random.Random(3)
    for trial in range(30):
        prefixes = [[rng.randrange(10_000) for _ in range(rng.randrange(1, 4))] for _ in range(3)]
        reqs = []
        for _ in range(8):   # a shared prefix of 1-3 blocks + 0-2 own blocks
            own = [rng.randrange(10_000, 20_000) for _ in range(rng.randrange(3))]
            keys = rng.choice(prefixes) + own
            reqs.append(Prompt(len(keys) * BS + 1, keys))
        cap = rng.randrange(1, 5)
        best = max(lru_routing_hits(reqs, route, 2, cap) for route in itertools.product(range(2), repeat=8))
        assert best <= ceiling(reqs, BS, 2 * cap).hit_tokens, trial


def test_workload_oracle_is_between_nothing_and_unbounded():
    reqs = create("agentic", seed=1, params={"system_tokens": 200, "tool_tokens": 100}).requests(40)
    small = oracle(reqs, 16, replicas=2, blocks_per_replica=20)
    big = oracle(reqs, 16, replicas=2, blocks_per_replica=10_000)
    unbounded = oracle(reqs, 16, replicas=2, blocks_per_replica=None)
    assert 0 < small.hit_rate < big.hit_rate == unbounded.hit_rate < 1


def belady_by_hand(keys: list[int], cap: int) -> int:
    """Block hits of Belady with bypass, simulated one access at a time: after each access the
    block stays only if it is used again, evicting the cached block needed farthest ahead when
    that one is needed later than it."""
    def next_use(i: int) -> float:
        return next((j for j in range(i + 1, len(keys)) if keys[j] == keys[i]), float("inf"))
    cached: dict[int, float] = {}   # key -> its next use
    hits = 0
    for i, k in enumerate(keys):
        hits += k in cached
        cached.pop(k, None)
        nu = next_use(i)
        if nu == float("inf") or cap <= 0:
            continue
        if len(cached) < cap:
            cached[k] = nu
            continue
        far = max(cached, key=cached.__getitem__)
        if cached[far] > nu:
            del cached[far]
            cached[k] = nu
    return hits


def test_ceiling_is_belady_at_every_capacity():
    # from a cache too small to keep anything to one that never has to choose (where every reuse
    # is a hit without simulating the cache)
    rng = random.Random(5)
    for trial in range(40):
        keys = [rng.randrange(rng.randrange(2, 30)) for _ in range(rng.randrange(1, 120))]
        reqs = [Prompt(len(keys[i:i + 3]) * BS, keys[i:i + 3]) for i in range(0, len(keys), 3)]
        for cap in range(len(set(keys)) + 2):
            assert ceiling(reqs, BS, cap).hit_tokens == belady_by_hand(keys, cap) * BS, (trial, cap)


def test_prompts_keyed_as_runs_give_the_ceiling_of_their_keys_listed():
    """A twin trace prompt's keys come as runs (`RunKeys`), read all at once: the same ceiling as
    the keys listed, at every capacity, keys near 2**64 included (unsigned arithmetic wraps)."""
    from kvlab.kvcache.runkeys import RunKeys

    rng = random.Random(9)
    runs = [[(a, a + rng.randrange(1, 6)) for a in sorted(rng.sample(range(40), rng.randrange(1, 4)))]
            for _ in range(30)]
    runs.append([((1 << 64) - 3, (1 << 64) - 1)])
    as_runs = [Prompt(40, RunKeys(r)) for r in runs]
    listed = [Prompt(40, [k for a, b in r for k in range(a, b)]) for r in runs]
    for cap in (None, 0, 3, 10, 100):
        assert ceiling(as_runs, BS, cap) == ceiling(listed, BS, cap), cap
