"""Typed KV retention in the simulator (engine/sim/retention.py, docs/semantic-kv.md): eviction order
by class, the pinned share's bound, directive parsing, 400s for bad directives, the BlockStored key."""

from __future__ import annotations

import json

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.retention import (
    EVICT_FIRST,
    HIGH,
    NORMAL,
    PINNED,
    RetentionDirective,
    block_classes,
    parse,
)
from kvlab.engine.sim.scheduler import Request, Scheduler
from kvlab.errors import RequestError
from kvlab.kvcache.events import BlockStored, KVEventBatch, decode_batch, encode_batch
from kvlab.telemetry import names
from test_sim_server import MODEL, run_with_replica


def _cached(pool: BlockPool, n: int, cls: int, base: int) -> list:
    """`n` blocks cached under keys base.. with class `cls`, then freed (evictable)."""
    blocks = pool.allocate(n)
    assert blocks is not None
    pool.cache(blocks, [base + i for i in range(n)], None, list(range(n * pool.block_size)), [cls] * n)
    pool.free(reversed(blocks))
    return blocks


def test_eviction_order_follows_classes_not_recency():
    pool = BlockPool(8, 4, pinned_share=0.5)
    _cached(pool, 2, PINNED, 100)       # oldest
    _cached(pool, 2, HIGH, 200)
    _cached(pool, 2, NORMAL, 300)
    _cached(pool, 2, EVICT_FIRST, 400)  # newest
    order = []
    for _ in range(8):
        (block,) = pool.allocate(1) or []
        order.append(block.id)
    # evict-first, then normal, then high, pinned last; LRU within a class (a request's blocks are
    # freed tail first, so its tail goes first)
    assert order == [7, 6, 5, 4, 3, 2, 1, 0]
    assert pool.typed is not None and pool.typed.stats.evictions == [2, 2, 2, 2]


def test_untyped_pool_stays_lru():
    pool = BlockPool(4, 4)
    _cached(pool, 2, PINNED, 100)
    _cached(pool, 2, EVICT_FIRST, 200)
    assert [b.id for b in pool.allocate(4) or []] == [1, 0, 3, 2]   # classes ignored: plain LRU


def test_pinned_share_is_bounded():
    pool = BlockPool(10, 4, pinned_share=0.3)
    _cached(pool, 6, PINNED, 100)
    typed = pool.typed
    assert typed is not None
    assert typed.pinned == 3 and typed.stats.pins_refused == 3
    assert [b.cls for b in pool.blocks[:6]] == [PINNED] * 3 + [HIGH] * 3
    # pinned blocks go last but do go: allocation never fails for lack of unpinned blocks
    assert pool.allocate(10) is not None
    assert typed.pinned == 0


def test_scheduler_classes_blocks_from_directives():
    pool = BlockPool(64, 4, pinned_share=0.25)
    sched = Scheduler(pool, 8, 256)
    prompt = list(range(1, 40))
    directives = [RetentionDirective(start=0, end=10, priority=100), RetentionDirective(start=10, end=None, priority=5)]
    req = Request("r", prompt, [7, 7], sched.prompt_keys(prompt), retention=directives)
    sched.add(req)
    batch = sched.schedule()
    sched.complete(batch)
    classes = [b.cls for b in req.blocks if b.key is not None]
    # 0-7 pinned (blocks 0, 1), block 2 straddles tokens 8-11: the lower class (evict-first)
    assert classes[:3] == [PINNED, PINNED, EVICT_FIRST]
    assert set(classes[3:]) == {EVICT_FIRST}
    events = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert events[0].retention_classes is not None
    assert events[0].retention_classes[:3] == ["pinned", "pinned", "evict-first"]


def test_block_classes_lowest_class_wins_and_uncovered_is_normal():
    d = [RetentionDirective(start=0, end=6, priority=95), RetentionDirective(start=6, end=8, priority=70)]
    assert block_classes(d, 3, 4) == [PINNED, HIGH, NORMAL]


@pytest.mark.parametrize("raw, message", [
    ([{"start": 0, "end": 10}], "priority"),
    ([{"start": 0, "end": 10, "priority": 101}], "between 0 and 100"),
    ([{"start": 5, "end": 5, "priority": 50}], "greater than start"),
    ([{"start": -1, "priority": 50}], ">= 0"),
    ([{"start": 0, "end": 10, "priority": 50}, {"start": 8, "priority": 50}], "overlap"),
    ([{"start": 0, "priority": 50, "duration": 0}], "duration"),
    ([{"start": 0, "priority": 50, "colour": "red"}], "colour"),
    ({"start": 0}, "array"),
    ("not json", "invalid"),
])
def test_bad_directives_are_request_errors(raw, message):
    with pytest.raises(RequestError, match=message) as info:
        parse(raw)
    assert info.value.param == "retention_directives"


def test_directives_parse_from_body_and_header_forms():
    body = [{"start": 0, "end": 16, "priority": 80, "duration": 30.0}]
    assert parse(body) == parse(json.dumps(body)) == [RetentionDirective(start=0, end=16, priority=80, duration=30.0)]


def test_server_rejects_bad_directives_with_openai_400_and_counts_classes():
    chat = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": "You are a careful agent. " * 20},
                         {"role": "user", "content": "go"}]}

    async def fn(session, replica):
        out = {}
        async with session.post("/v1/chat/completions", json={**chat, "retention_directives": [{"start": 0}]}) as r:
            out["body"] = (r.status, await r.json())
        bad_header = {names.HEADER_RETENTION: '[{"start": 0, "priority": 500}]'}
        async with session.post("/v1/chat/completions", json=chat, headers=bad_header) as r:
            out["header"] = (r.status, await r.json())
        good = {names.HEADER_RETENTION: '[{"start": 0, "end": 64, "priority": 100}]'}
        for _ in range(2):
            async with session.post("/v1/chat/completions", json=chat, headers=good) as r:
                assert r.status == 200
                await r.json()
        async with session.get("/metrics") as r:
            out["metrics"] = await r.text()
        return out

    out = run_with_replica(fn, "--typed-retention", "0.25", "--block-size", "16")
    for status, body in (out["body"], out["header"]):
        assert status == 400
        assert body["error"]["type"] == "BadRequestError" and body["error"]["param"] == "retention_directives"
    samples = {(s.name, s.labels.get("retention_class")): s.value
               for f in text_string_to_metric_families(out["metrics"]) for s in f.samples}
    assert samples[(names.KVLAB_SIM_KV_BLOCKS, "pinned")] == 4          # 64 tokens / 16
    assert samples[(names.KVLAB_SIM_BLOCK_HITS + "_total", "pinned")] == 4  # the second request hit them
    assert samples[(names.KVLAB_SIM_PINNED_USAGE, None)] > 0


# vLLM's own event structs (vllm/distributed/kv_events.py): positional, without kvlab's key
class _VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _VllmBlockStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _VllmMapStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


def test_block_stored_class_key_is_ignored_by_consumers_that_do_not_know_it():
    ev = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                     medium="GPU", retention_classes=["pinned", "normal"])
    # kvlab's own encoding (map events): a consumer with vLLM's fields skips the unknown key
    payload = encode_batch(KVEventBatch(ts=1.0, events=[ev]))
    raw = msgspec.msgpack.decode(payload)
    assert msgspec.convert(raw["events"][0], _VllmMapStored).block_hashes == [1, 2]
    assert decode_batch(payload).events[0] == ev
    # the positional form vLLM's structs use: the class is a trailing element, dropped on decode
    positional = msgspec.msgpack.encode(["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU",
                                         None, None, None, None, None, ["pinned", "normal"]])
    got = msgspec.msgpack.decode(positional, type=_VllmBlockStored)
    assert got.block_hashes == [1, 2] and got.medium == "GPU"


def test_precise_index_keeps_the_class_until_removed():
    from kvlab.kvcache.events import BlockRemoved
    from kvlab.kvcache.index import PreciseIndex

    idx = PreciseIndex()
    tokens = list(range(48))
    idx.apply("r0", [BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=tokens, block_size=16,
                                 retention_classes=["pinned", "normal", "evict-first"])])
    from kvlab.kvcache.hashing import block_keys
    keys = block_keys(tokens, 16)
    assert idx.prefix_classes("r0", keys) == {"pinned": 1, "normal": 1, "evict-first": 1}
    idx.apply("r0", [BlockRemoved(block_hashes=[13])])
    assert idx.prefix_classes("r0", keys) == {"pinned": 1, "normal": 1}
    idx.apply("r1", [BlockStored(block_hashes=[21], parent_block_hash=None, token_ids=tokens[:16], block_size=16)])
    assert idx.prefix_classes("r1", keys) == {}   # an untyped replica


def test_a_preempted_request_keeps_its_evict_first_blocks_until_it_resumes():
    pool = BlockPool(64, 4, pinned_share=0.25)
    sched = Scheduler(pool, 8, 256)
    prompt = list(range(1, 40))
    req = Request("r", prompt, [7] * 8, sched.prompt_keys(prompt),
                  retention=[RetentionDirective(start=0, end=None, priority=5)])
    sched.add(req)
    batch = sched.schedule()
    sched.complete(batch)
    assert {b.cls for b in req.blocks if b.key is not None} == {EVICT_FIRST}
    sched._preempt(req, sched.schedule())
    assert pool.typed is not None and pool.typed.counts()[EVICT_FIRST] == 0   # queued as normal
