"""The block index: precise (KV-event sequences incl. parents, removals, clears, gaps, restarts)
and approximate (learned, LRU-bounded)."""

from __future__ import annotations

import random

from kvlab.contract import Endpoint
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.kvevents import EventFeed
from kvlab.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
from kvlab.kvcache.transport import Received

BS = 16


def engine_hashes(tokens, seed=99):
    return block_keys(tokens, BS, seed=seed)   # the "engine's" own hash family


def stored(tokens, start_block, n_blocks, parent_engine=None):
    toks = tokens[start_block * BS:(start_block + n_blocks) * BS]
    eh = engine_hashes(tokens)[start_block:start_block + n_blocks]
    return BlockStored(block_hashes=eh, parent_block_hash=parent_engine, token_ids=toks, block_size=BS)


def test_precise_match_with_chained_parents_and_removal():
    rng = random.Random(1)
    prompt = [rng.randrange(2000) for _ in range(10 * BS + 5)]
    idx = PreciseIndex()
    eh = engine_hashes(prompt)
    # stored in two events: blocks 0-3, then 4-7 chained through the engine hash of block 3
    idx.apply("a", [stored(prompt, 0, 4), stored(prompt, 4, 4, parent_engine=eh[3])])
    idx.apply("b", [stored(prompt, 0, 2)])
    keys = {BS: block_keys(prompt, BS)}
    m = idx.match(keys, {"a": BS, "b": BS, "c": BS})
    assert m == {"a": 8 * BS, "b": 2 * BS, "c": 0}
    # removing block 5 on a cuts a's prefix at 5 blocks
    idx.apply("a", [BlockRemoved(block_hashes=[eh[5]])])
    assert idx.match(keys, {"a": BS})["a"] == 5 * BS
    assert idx.blocks("a") == 7
    idx.apply("a", [AllBlocksCleared()])
    assert idx.match(keys, {"a": BS, "b": BS}) == {"a": 0, "b": 2 * BS}


def test_unknown_parent_is_skipped_not_guessed():
    prompt = list(range(4 * BS))
    idx = PreciseIndex()
    idx.apply("a", [stored(prompt, 2, 2, parent_engine=12345)])
    assert idx.unresolved == 2 and idx.blocks("a") == 0
    assert idx.match({BS: block_keys(prompt, BS)}, {"a": BS})["a"] == 0


def test_block_sizes_differ_per_replica():
    prompt = list(range(100, 100 + 64))
    idx = PreciseIndex()
    idx.apply("small", [BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=prompt[:32], block_size=16)])
    idx.apply("big", [BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=prompt[:32], block_size=32)])
    keys = {16: block_keys(prompt, 16), 32: block_keys(prompt, 32)}
    assert idx.match(keys, {"small": 16, "big": 32}) == {"small": 32, "big": 32}
    # matching big with the wrong block size finds nothing: keys depend on the block size
    assert idx.match(keys, {"big": 16}) == {"big": 0}


def _replica(name="a"):
    return Backend(Endpoint(name=name, url="http://x"), events_state="connecting")


def test_feed_gap_marks_stale_and_restart_clears_both_indexes():
    prompt = list(range(8 * BS))
    precise, approx = PreciseIndex(), ApproximateIndex()
    feed = EventFeed(precise, approx, resync_s=0.0)
    r = _replica()
    keys = {BS: block_keys(prompt, BS)}
    feed.ingest(r, Received(0, KVEventBatch(ts=0, events=[stored(prompt, 0, 4)])))
    assert r.events_state == "live" and precise.match(keys, {"a": BS})["a"] == 4 * BS
    # batches 1-2 lost: the entries can no longer be trusted
    feed.ingest(r, Received(3, KVEventBatch(ts=0, events=[]), gap=2))
    assert precise.match(keys, {"a": BS})["a"] == 0 and r.events_gaps == 1
    feed.resync_s = 60
    feed.ingest(r, Received(5, KVEventBatch(ts=0, events=[]), gap=1))
    assert r.events_state == "stale"
    feed.ingest(r, Received(6, KVEventBatch(ts=0, events=[stored(prompt, 0, 2)])))
    assert r.events_state == "stale"           # not trusted again before resync_s
    assert precise.match(keys, {"a": BS})["a"] == 2 * BS   # but rebuilding already
    approx.learn("a", keys[BS], BS)
    feed.ingest(r, Received(0, KVEventBatch(ts=0, events=[]), restarted=True))
    assert precise.match(keys, {"a": BS})["a"] == 0
    assert approx.match(keys, {"a": BS})["a"] == 0 and r.events_restarts == 1


def test_approximate_lru_is_bounded_and_learns_prefixes():
    idx = ApproximateIndex(capacity_blocks=10)
    p1 = list(range(8 * BS))
    p2 = list(range(5000, 5000 + 8 * BS))
    k1, k2 = block_keys(p1, BS), block_keys(p2, BS)
    idx.learn("a", k1, BS)
    assert idx.match({BS: k1}, {"a": BS, "b": BS}) == {"a": 8 * BS, "b": 0}
    idx.learn("a", k2, BS)          # 16 blocks > 10: the oldest (p1's first 6) are evicted
    assert idx.blocks("a") == 10
    assert idx.match({BS: k1}, {"a": BS})["a"] == 0
    assert idx.match({BS: k2}, {"a": BS})["a"] == 8 * BS
    idx.remove("a")
    assert idx.match({BS: k2}, {"a": BS})["a"] == 0 and not idx.table.masks


def test_many_replicas_bits_are_reused():
    idx = PreciseIndex()
    prompt = list(range(2 * BS))
    for i in range(70):   # more than 64 replicas over time: bits are freed and reused
        idx.apply(f"r{i}", [BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=prompt[:BS], block_size=BS)])
        if i % 2:
            idx.remove(f"r{i}")
    keys = {BS: block_keys(prompt, BS)}
    m = idx.match(keys, {f"r{i}": BS for i in range(70)})
    assert all(m[f"r{i}"] == (0 if i % 2 else BS) for i in range(70))


def test_engine_keys_take_the_events_hashes_as_keys():
    """The twin's engines hash with the gateway's family: with `engine_keys` the index keys a
    BlockStored by its hashes (its token ids are not re-hashed), parents and removals alike."""
    rng = random.Random(3)
    prompt = [rng.randrange(2000) for _ in range(6 * BS)]
    ours = block_keys(prompt, BS)
    keys = {BS: ours}
    idx = PreciseIndex(engine_keys=True)
    other = [t + 1 for t in prompt]     # token ids that would hash elsewhere: only the hashes count
    idx.apply("a", [BlockStored(block_hashes=ours[:3], parent_block_hash=None, token_ids=other[:3 * BS],
                                block_size=BS),
                    BlockStored(block_hashes=ours[3:], parent_block_hash=ours[2], token_ids=other[3 * BS:],
                                block_size=BS)])
    assert idx.match(keys, {"a": BS})["a"] == 6 * BS and idx.blocks("a") == 6
    idx.apply("a", [BlockRemoved(block_hashes=[ours[4]])])
    assert idx.match(keys, {"a": BS})["a"] == 4 * BS
    # the live gateway's index re-keys from the token ids, so the same events match nothing
    live = PreciseIndex()
    live.apply("a", [BlockStored(block_hashes=ours, parent_block_hash=None, token_ids=other, block_size=BS)])
    assert live.match(keys, {"a": BS})["a"] == 0


def test_engine_keys_hold_what_re_keying_holds():
    """The twin's index takes the events' hashes as its keys, the live one keys blocks by their token
    ids: the same random run of stores and removals in both tiers, speculation, expiry, clears and
    replicas leaving, told once with hashes of our family (a twin engine's) and once with an engine's
    own, leaves both indexes answering alike after every step."""
    rng = random.Random(11)
    roots = [[rng.randrange(500) for _ in range(6 * BS)] for _ in range(3)]
    prompts = [r[:k * BS] + [rng.randrange(500) for _ in range(4 * BS)] for r in roots for k in (2, 6)]
    ours = [block_keys(p, BS) for p in prompts]
    theirs = [engine_hashes(p) for p in prompts]
    now = [0.0]
    twin, live = (PreciseIndex(speculative_ttl_s=5.0, clock=lambda: now[0], engine_keys=e) for e in (True, False))
    sizes = dict.fromkeys("abc", BS)
    held: dict[tuple[str, str], set[int]] = {}   # (replica, tier) -> our keys stored and not removed
    for _ in range(600):
        r, p, op = rng.choice("abc"), rng.randrange(len(prompts)), rng.random()
        medium = rng.choice(("GPU", "GPU", "CPU"))
        mine = held.setdefault((r, medium), set())
        if op < 0.45:   # store a run of blocks whose parent the replica holds (or the first ones)
            start = rng.choice([0] + [i + 1 for i, k in enumerate(ours[p]) if k in mine])
            end = min(start + rng.randint(1, 4), len(ours[p]))
            for idx, hashes in ((twin, ours[p]), (live, theirs[p])):
                idx.apply(r, [BlockStored(block_hashes=hashes[start:end], parent_block_hash=hashes[start - 1] if start else None,
                                          token_ids=prompts[p][start * BS:end * BS], block_size=BS, medium=medium)])
            mine.update(ours[p][start:end])
        elif op < 0.7:
            gone = [i for i, k in enumerate(ours[p]) if k in mine and rng.random() < 0.5]
            for idx, hashes in ((twin, ours[p]), (live, theirs[p])):
                idx.apply(r, [BlockRemoved(block_hashes=[hashes[i] for i in gone], medium=medium)])
            mine.difference_update(ours[p][i] for i in gone)
        elif op < 0.9:
            assert twin.speculate(r, ours[p]) == live.speculate(r, ours[p])
        elif op < 0.95:
            now[0] += rng.choice((1.0, 6.0))
        elif op < 0.98:
            for idx in (twin, live):
                idx.apply(r, [AllBlocksCleared()])
            held.pop((r, "GPU"), None)
            held.pop((r, "CPU"), None)
        else:
            for idx in (twin, live):
                idx.remove(r)
            held.pop((r, "GPU"), None)
            held.pop((r, "CPU"), None)
        for keys in ours:
            for spec in (True, False):
                assert twin.match({BS: keys}, sizes, spec, True) == live.match({BS: keys}, sizes, spec, True)
                assert twin.match({BS: keys}, sizes, spec) == live.match({BS: keys}, sizes, spec)
        for name in sizes:
            assert (twin.blocks(name), twin.cpu_blocks(name), twin.speculative_blocks(name)) == \
                (live.blocks(name), live.cpu_blocks(name), live.speculative_blocks(name))
            assert twin.blocks(name) == len(held.get((name, "GPU"), ()))
    assert (twin.total_blocks(), twin.confirmed, twin.expired, twin.unresolved) == \
        (live.total_blocks(), live.confirmed, live.expired, live.unresolved)
    assert twin.confirmed > 0 and twin.expired > 0 and twin.total_blocks() > 0


def test_an_index_that_drops_unread_keys_answers_every_lookup_below_them_alike():
    """The twin tells its index from which key up no lookup will read a block (twin/keys.py): a
    random run of stores (runs that cross the line, parents on either side), removals, speculation,
    expiry and clears leaves it answering every lookup of keys below the line as an index that
    keeps every block, holding none of the blocks above it."""
    rng = random.Random(5)
    line = 1000
    prompts = [[1, 2] + list(range(10 * p + 3, 10 * p + 3 + rng.randint(0, 4))) + list(range(line + 10 * p, line + 10 * p + 4))
               for p in range(12)]   # shared keys (a common head) first, then the prompt's own
    now = [0.0]
    told, kept = (PreciseIndex(speculative_ttl_s=5.0, clock=lambda: now[0], engine_keys=True) for _ in range(2))
    told.unread_from = line
    sizes = dict.fromkeys("abc", BS)
    above = 0
    for _ in range(800):
        r, keys, op = rng.choice("abc"), rng.choice(prompts), rng.random()
        medium = rng.choice(("GPU", "GPU", "CPU"))
        if op < 0.45:
            start = rng.randrange(len(keys))
            end = min(start + rng.randint(1, 5), len(keys))
            for idx in (told, kept):
                idx.apply(r, [BlockStored(block_hashes=keys[start:end], parent_block_hash=keys[start - 1] if start else None,
                                          token_ids=[0] * BS * (end - start), block_size=BS, medium=medium)])
        elif op < 0.7:
            gone = [k for k in keys if rng.random() < 0.4]
            for idx in (told, kept):
                idx.apply(r, [BlockRemoved(block_hashes=gone, medium=medium)])
        elif op < 0.9:
            for idx in (told, kept):
                idx.speculate(r, keys)
        elif op < 0.97:
            now[0] += rng.choice((1.0, 6.0))
        else:
            for idx in (told, kept):
                idx.apply(r, [AllBlocksCleared()])
        for keys in prompts:
            below = {BS: [k for k in keys if k < line]}
            for spec in (True, False):
                for cpu in (True, False):
                    assert told.match(below, sizes, spec, cpu) == kept.match(below, sizes, spec, cpu)
        assert not any(k >= line for layer in (told.table.masks, told.table.speculative, told.table.offloaded)
                       for k in layer)
        above += sum(k >= line for k in kept.table.masks)
    assert above > 1000   # the other index held such blocks all along


def test_a_router_without_fallback_learns_only_replicas_off_the_precise_index():
    """`fallback=False` (the twin, whose event streams never go stale): a replica on the precise
    index is not learned by the approximate one; a replica whose feed is not live still is."""
    from kvlab.gateway.config import load_policy
    from kvlab.gateway.endpoints import Registry
    from kvlab.gateway.router import Router
    from kvlab.gateway.scheduler import presets

    cfg = load_policy("kv-aware")
    prompt = list(range(1, 1 + 8 * BS))
    learned = {}
    for fallback in (True, False):
        reg = Registry()
        reg.update([Endpoint(name="a", url="http://a"), Endpoint(name="b", url="http://b")])
        for r in reg.replicas.values():
            r.block_size = BS
        reg.replicas["a"].events_state, reg.replicas["b"].events_state = "live", "connecting"
        approx = ApproximateIndex()
        router = Router(cfg, reg, PreciseIndex(cfg.index.speculative_ttl_s), approx, presets.build(cfg),
                        fallback=fallback)
        for r in reg.replicas.values():
            router.learn(r, {BS: block_keys(prompt, BS)})
        learned[fallback] = {n: approx.blocks(n) for n in ("a", "b")}
    assert learned[True] == {"a": 8, "b": 8}
    assert learned[False] == {"a": 0, "b": 8}
