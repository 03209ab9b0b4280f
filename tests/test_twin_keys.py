"""The twin keys a trace's prompts by their structure (twin/keys.py): the keys must say two
blocks are equal exactly when hashing their tokens says so, for any block size and token scale,
except where the windows of two different ids coincide: there the keys follow the ids."""

from __future__ import annotations

import json
import random
from collections import Counter
from itertools import islice

import pytest

from kvlab.kvcache.hashing import block_keys
from kvlab.load.workloads import create
from kvlab.load.workloads.trace import Trace
from kvlab.twin import feed as feed_module
from kvlab.twin.feed import Feed


def _rows(n: int, seed: int = 7) -> list[dict[str, object]]:
    """Sessions that grow turn by turn (each turn a prefix of the next), prompts that branch off a
    shared prefix, ids reused under another prefix, lengths that end inside a block."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    chains: list[list[int]] = [[0, 1]]
    fresh = 2
    for i in range(n):
        base = rng.choice(chains)
        if rng.random() < 0.2:
            ids = [rng.randrange(fresh)] + base[1:]           # an old id under a prefix it never had
        else:
            ids = base[:rng.randint(1, len(base))] + list(range(fresh, fresh + rng.randint(0, 3)))
        fresh += 4
        chains.append(ids)
        tokens = rng.randint(512 * (len(ids) - 1) + 1, 512 * len(ids))
        rows.append({"timestamp": i * 100, "input_length": tokens, "output_length": rng.choice([4, 150]),
                     "hash_ids": ids})   # 150: a chunked answer takes more than one call
    return rows


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(60)))
    return path


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_structural_keys_match_exactly_when_hashed_tokens_do(trace_path, scale):
    feed = Feed(Trace(seed=3, params={"path": str(trace_path), "token_scale": scale}))
    prompts = [p for session in islice(feed.sessions(), 150) for p in session]   # the trace 2.5 times
    assert {p.round_ for p in prompts} == {0, 1, 2}
    for bs in (8, 16, 48, 512, 1000):
        by_key: dict[int, int] = {}
        by_hash: dict[int, int] = {}
        for p in prompts:
            keys, hashed = feed.block_keys(p, bs), block_keys(p.tokens, bs)
            assert len(keys) == len(hashed) == len(p.tokens) // bs
            for k, h in zip(keys, hashed):
                assert by_key.setdefault(k, h) == h, f"one key for two different prefixes (bs {bs})"
                assert by_hash.setdefault(h, k) == k, f"two keys for one prefix (bs {bs})"
        assert len(by_key) > 0.25 * sum(len(p.tokens) // bs for p in prompts)   # not one long shared prefix
    # a block of a few tokens is hashed: windows of a few hundred words often begin alike
    assert all(feed.block_keys(p, 2) == block_keys(p.tokens, 2) for p in prompts[:5])



def test_a_trace_prompts_ids_read_in_pieces_are_its_ids(trace_path):
    """A trace prompt's ids are made where read (feed.py `TraceTokens`): any slice, index or
    iteration gives what the whole prompt, assembled window by window, holds."""
    feed = Feed(Trace(seed=3, params={"path": str(trace_path), "token_scale": 0.7}))
    trace = feed.workload
    rng = random.Random(5)
    for p in (s[0] for s in islice(feed.sessions(), 70)):   # into the second round
        assert p.row is not None
        size = trace.block_tokens
        whole = list(feed._head)
        for h in p.row.hash_ids:
            at = hash((trace.seed, p.round_, h)) % (len(feed._pool) - size)
            whole += feed._pool[at:at + size]
        whole = whole[:len(feed._head) + feed_module.trace_prompt_tokens(trace, p.row)] + feed._tail
        assert len(p.tokens) == len(whole) and list(p.tokens) == whole
        for _ in range(20):
            a, b = sorted(rng.randrange(-5, len(whole) + 5) for _ in range(2))
            assert p.tokens[a:b] == whole[a:b] and p.tokens[b:a] == whole[b:a]
            assert p.tokens[a:] == whole[a:] and p.tokens[::-7] == whole[::-7]
            i = rng.randrange(-len(whole), len(whole))
            assert p.tokens[i] == whole[i]
        with pytest.raises(IndexError):
            p.tokens[len(whole)]

@pytest.mark.parametrize("sent", [45, 65, 150])   # part of a round, all of one, two and a half
def test_a_key_from_unread_up_is_held_by_one_sent_prompt_alone(tmp_path, sent):
    """Told how many prompts will be sent, the keys put the blocks only one of them holds from
    `unread` up, where the twin's index drops them: none may be another's (a shared chain, or the
    tail of a prompt sent twice), and most of a trace's blocks are there."""
    rows = _rows(60)
    rows += [dict(r, timestamp=6000 + i) for i, r in enumerate(rows[50:55])]   # five prompts again
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    feed = Feed(Trace(seed=3, params={"path": str(path)}))
    prompts = [p for session in islice(feed.sessions(sent), sent) for p in session]
    for bs in (16, 48):
        unread = feed.unread(bs)
        assert unread is not None
        holders: dict[int, int] = {}
        for p in prompts:
            keys = feed.block_keys(p, bs)
            for k in set(keys):
                holders[k] = holders.get(k, 0) + 1
            above = [k >= unread for k in keys]
            assert above == sorted(above)   # a prompt's unread blocks come after its others (the index bisects)
        assert all(n == 1 for k, n in holders.items() if k >= unread)
        assert sum(k >= unread for k in holders) > 0.5 * len(holders)
        assert any(n > 1 and k > feed._keys.head // bs for k, n in holders.items())   # shared ones stay below
    beyond = next(islice(feed.sessions(sent), sent, None))[0]
    with pytest.raises(ValueError, match="begun for"):
        feed.block_keys(beyond, 16)
    assert next(feed.sessions()) and feed.unread(16) is None   # not told: nothing unread


def test_where_two_ids_windows_coincide_the_keys_follow_the_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(feed_module, "_POOL", 1)   # one window: every id's tokens are the same
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": ids})
                            + "\n" for ids in ([1, 2], [3, 4])))
    feed = Feed(Trace(seed=3, params={"path": str(path)}))
    a, b = (s[0] for s in islice(feed.sessions(), 2))
    past_head = (len(feed._head) + 512) // 16       # the blocks through the first trace block
    assert block_keys(a.tokens, 16)[:past_head] == block_keys(b.tokens, 16)[:past_head]
    ka, kb = feed.block_keys(a, 16), feed.block_keys(b, 16)
    shared = len(feed._head) // 16
    assert ka[:shared] == kb[:shared] and ka[shared] != kb[shared]


def test_a_prompts_new_blocks_get_consecutive_small_keys(trace_path):
    feed = Feed(Trace(seed=3, params={"path": str(trace_path)}))
    first = next(feed.sessions())[0]
    assert first.row is not None
    keys = feed.block_keys(first, 16)
    inside = (len(feed._head) + first.row.input_length) // 16   # the blocks before the template's tail
    assert keys[:inside] == list(range(1, inside + 1))


def test_other_workloads_are_hashed_as_the_gateway_hashes_them():
    feed = Feed(create("multi-turn"))
    prompt = next(feed.sessions())[0]
    assert prompt.row is None
    assert feed.block_keys(prompt, 16) == block_keys(prompt.tokens, 16)


@pytest.mark.parametrize("topology", ["quickstart", "pd", "chunked"])
def test_a_twin_run_gives_the_same_records_keyed_by_structure_or_by_hash(trace_path, topology, monkeypatch):
    """The router, the engines, a P/D decode call and a chunk's next call all take the keys: a
    run keyed by the trace's structure (whose index keeps no block no lookup reads) is the run
    keyed by hashing (whose index keeps every block), request for request."""
    import msgspec

    from kvlab.twin.cluster import Cluster
    from kvlab.twin.settings import TwinSettings, resolve

    def records() -> bytes:
        plan = resolve(TwinSettings(topology=topology, trace=str(trace_path), requests=40, time_scale=0.2,
                                    num_blocks=600))   # few: blocks are evicted, stale LRU entries skipped
        return msgspec.json.encode(Cluster(plan).run().records)

    structural = records()   # by key runs (runpool.py, kvcache/intervals.py): the keys ascend
    monkeypatch.setattr(Feed, "keys_ascend", lambda self, bs: False)
    assert records() == structural   # the same keys on BlockPool and the precise index
    monkeypatch.setattr(Feed, "block_keys", lambda self, prompt, bs: block_keys(prompt.tokens, bs))
    monkeypatch.setattr(Feed, "unread", lambda self, bs: None)
    assert records() == structural



def test_answers_keyed_by_structure_give_the_records_of_hashed_answers(trace_path, monkeypatch):
    """An answer's blocks keyed by structure (keys.py `AnswerKeys`) in place of hashed: the same
    records and index, with preempted requests whose recompute finds their answer's blocks."""
    import msgspec

    from kvlab.twin import cluster as cluster_module
    from kvlab.twin.cluster import Cluster
    from kvlab.twin.settings import TwinSettings, resolve

    def run() -> tuple[bytes, list[int], list[int | None], int, bool]:
        plan = resolve(TwinSettings(trace=str(trace_path), requests=60, time_scale=0.05, num_blocks=300,
                                    max_model_len=4096))   # few blocks, a busy minute: preemptions
        cluster = Cluster(plan)
        records = msgspec.json.encode(cluster.run().records)
        index = cluster.gateway.precise
        return (records, index.table.starts, index.table.values, sum(r.sched.preemptions for r in cluster.replicas),
                all(r.sched.answer_keys is not None for r in cluster.replicas))

    *structural, preempted, by_structure = run()
    assert by_structure and preempted > 0
    monkeypatch.setattr(cluster_module, "AnswerKeys", lambda *args: None)   # hashed by the engines
    *hashed, _, by_structure = run()
    assert not by_structure
    assert structural == hashed


def test_kv_events_the_index_would_skip_whole_are_not_delivered(trace_path, monkeypatch):
    """An answer's blocks, stored or evicted, are keyed from `unread` up: the pools leave them out
    of their KV events (runpool.py `RunPool.quiet`), an event left with none is not delivered, and
    the index ends as it ends when every event is."""
    import msgspec

    from kvlab.engine.sim.runpool import RunPool
    from kvlab.twin import cluster as cluster_module
    from kvlab.twin.cluster import Cluster
    from kvlab.twin.settings import TwinSettings, resolve

    def run() -> tuple[bytes, list[int], list[int], Counter[str]]:
        plan = resolve(TwinSettings(trace=str(trace_path), requests=60, time_scale=0.2, num_blocks=400,
                                    max_model_len=4096))   # few blocks: the index's blocks are evicted too
        cluster = Cluster(plan)
        index = cluster.gateway.precise
        delivered: Counter[str] = Counter()
        apply = index.apply

        def counted(replica, events, *args):
            events = list(events)
            delivered.update(type(e).__name__ for e in events)
            return apply(replica, events, *args)
        monkeypatch.setattr(index, "apply", counted)
        records = msgspec.json.encode(cluster.run().records)
        return records, index.table.starts, index.table.values, delivered

    *skipped, fewer = run()
    monkeypatch.setattr(RunPool, "quiet", property(lambda self: 1 << 64, lambda self, line: None),
                        raising=False)   # every key reported
    monkeypatch.setattr(cluster_module, "_read", lambda event, unread: True)
    *every, all_events = run()
    assert skipped == every
    assert all_events["BlockRemoved"] > 0   # evictions happened
    assert fewer["BlockStored"] < all_events["BlockStored"] and fewer["BlockRemoved"] < all_events["BlockRemoved"]

def test_a_trace_run_keeps_its_index_and_pools_by_key_runs_where_it_can(trace_path):
    from kvlab.engine.sim.blockpool import BlockPool
    from kvlab.engine.sim.runpool import RunPool
    from kvlab.kvcache.index import PreciseIndex
    from kvlab.kvcache.intervals import IntervalIndex
    from kvlab.twin.cluster import Cluster
    from kvlab.twin.settings import TwinSettings, resolve

    def kinds(**kw: object) -> tuple[type, set[type]]:
        cluster = Cluster(resolve(TwinSettings(**kw)))   # type: ignore[arg-type]
        return type(cluster.gateway.precise), {type(r.pool) for r in cluster.replicas}

    assert kinds(trace=str(trace_path)) == (IntervalIndex, {RunPool})
    assert kinds(trace=str(trace_path), block_size=4) == (PreciseIndex, {BlockPool})   # hashed: keys in no order
    assert kinds(trace=str(trace_path), topology="tiered") == (PreciseIndex, {BlockPool})   # a CPU tier
    assert kinds() == (PreciseIndex, {BlockPool})   # a chat workload's keys are hashed
