"""The simulator's CPU offload tier (engine/sim/tier.py): store on compute, LRU eviction from CPU,
loading back to GPU on a GPU miss, and the events vLLM's offloading connector publishes."""

from __future__ import annotations

from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.profile import LatencyProfile
from kvlab.engine.sim.scheduler import Request, Scheduler
from kvlab.engine.sim.tier import CpuTier
from kvlab.kvcache.events import (
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.index import PreciseIndex


def _keys(n: int, start: int = 0) -> list[int]:
    return block_keys(list(range(start, start + 4 * n)), 4, seed=7)


def _by_medium(events: list[Event], kind: type, medium: str) -> list:
    return [e for e in events if isinstance(e, kind) and e.medium == medium]


def test_tier_stores_new_blocks_once_and_evicts_lru_with_cpu_events():
    events: list[Event] = []
    tier = CpuTier(3, 4, events.append)
    a, b = _keys(2), _keys(2, start=100)
    tier.store(a, None, list(range(8)))
    tier.store(a, None, list(range(8)))          # already offloaded: touched, not stored again
    (stored,) = events
    assert isinstance(stored, BlockStored) and stored.medium == "CPU"
    assert stored.block_hashes == a and stored.token_ids == list(range(8))
    assert stored.parent_block_hash is None and stored.block_size == 4
    events.clear()
    tier.store(b, None, list(range(100, 108)))   # 4 blocks in a 3-block tier: a[0] is the LRU one
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert events[1].medium == "CPU" and events[1].block_hashes == [a[0]]
    assert a[0] not in tier and tier.lookup(a) == 0 and tier.lookup(b) == 2 and len(tier) == 3
    assert tier.evicted == 1


def test_partially_offloaded_chain_publishes_the_new_run_with_its_parent():
    events: list[Event] = []
    tier = CpuTier(8, 4, events.append)
    keys = _keys(3)
    tier.store(keys[:1], None, list(range(4)))
    events.clear()
    tier.store(keys, None, list(range(12)))
    (ev,) = events
    assert ev.block_hashes == keys[1:]
    assert ev.parent_block_hash == keys[0] and ev.token_ids == list(range(4, 12))


def _sched(gpu_blocks: int, cpu_blocks: int) -> Scheduler:
    return Scheduler(BlockPool(gpu_blocks, 4, cpu_blocks=cpu_blocks), 8, 64, hash_seed=3)


def _serve(s: Scheduler, prompt: list[int], rid: str) -> tuple[Request, list]:
    r = Request(rid, prompt, [1000, 1001], s.prompt_keys(prompt))
    s.add(r)
    batches = []
    while s.has_work():
        b = s.schedule()
        batches.append(b)
        s.complete(b)
    return r, batches


def test_gpu_eviction_demotes_to_cpu_and_a_hit_promotes_back_with_its_load_cost():
    s = _sched(gpu_blocks=5, cpu_blocks=16)
    first = list(range(17))                         # 4 full blocks
    _serve(s, first, "a")
    s.pool.take_events()
    _serve(s, list(range(500, 517)), "b")           # pushes a's blocks out of the 5-block GPU pool
    evs = s.pool.take_events()
    assert _by_medium(evs, BlockRemoved, "GPU")     # evicted from GPU ...
    assert not _by_medium(evs, BlockRemoved, "CPU")  # ... still offloaded
    assert not s.pool.cached_prefix(s.prompt_keys(first)[:1])
    r, batches = _serve(s, first, "c")
    assert r.num_cached == 16 and r.num_loaded == 16      # promoted from CPU, not recomputed
    assert batches[0].loaded_blocks == 4 and batches[0].prefill_tokens == 1
    assert s.external_hits == 16 and s.prefix_hits == 0
    promoted = _by_medium(s.pool.take_events(), BlockStored, "GPU")
    assert promoted and promoted[0].block_hashes[:4] == s.prompt_keys(first)[:4]
    assert s.pool.tier is not None and s.pool.tier.loaded == 4
    # the load is paid in the step: 4 blocks x kv_load_ms_per_block
    prof = LatencyProfile(description="t", source="t", step_overhead_ms=1, prefill_ms_per_token=1,
                          decode_ms_base=0, decode_ms_per_seq=0, kv_load_ms_per_block=0.5)
    b = batches[0]
    assert prof.step_ms(b.prefill_tokens, b.decode_seqs, 0.0, 1, b.loaded_blocks) == 1 + 1 + 4 * 0.5


def test_without_a_cpu_tier_the_same_sequence_recomputes():
    s = _sched(gpu_blocks=5, cpu_blocks=0)
    first = list(range(17))
    _serve(s, first, "a")
    _serve(s, list(range(500, 517)), "b")
    r, batches = _serve(s, first, "c")
    assert r.num_cached == 0 and batches[0].loaded_blocks == 0 and batches[0].prefill_tokens == 17


def test_cpu_eviction_loses_the_block_and_reset_clears_the_tier():
    s = _sched(gpu_blocks=5, cpu_blocks=4)
    _serve(s, list(range(17)), "a")
    _serve(s, list(range(500, 517)), "b")           # 4 more blocks: a's leave the 4-block CPU tier
    evs = s.pool.take_events()
    assert {h for e in _by_medium(evs, BlockRemoved, "CPU") for h in e.block_hashes} >= {
        *s.prompt_keys(list(range(17)))[:4]}
    r, _ = _serve(s, list(range(17)), "c")
    assert r.num_loaded == 0
    s.reset_prefix_cache()
    assert s.pool.tier is not None and len(s.pool.tier) == 0


def test_cpu_medium_round_trips_the_wire_and_feeds_the_index_tier():
    s = _sched(gpu_blocks=5, cpu_blocks=16)
    prompt = list(range(17))
    _serve(s, prompt, "a")
    _serve(s, list(range(500, 517)), "b")
    payload = encode_batch(KVEventBatch(ts=1.0, events=s.pool.take_events()))
    events = decode_batch(payload).events
    assert {e.medium for e in events if isinstance(e, BlockStored | BlockRemoved)} == {"GPU", "CPU"}
    idx = PreciseIndex()
    idx.apply("r0", events)
    keys = {4: block_keys(prompt, 4)}
    gpu, total = idx.match_tiers(keys, {"r0": 4})
    assert gpu["r0"] == 0 and total["r0"] == 16   # evicted from GPU, still in CPU
