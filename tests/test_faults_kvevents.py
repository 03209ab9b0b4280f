"""A KV-event stream that drops and resumes (the publisher unbinds, publishes into the void, binds
again; the subscriber reconnects by itself), over real ZMQ sockets (kvlab.scenarios.faults.kv_event_gap, shown in lab 11):

- with a replay endpoint (vLLM's protocol; the simulator serves it too), the lost batches are
  fetched and applied, the replica's index never goes stale and holds every block;
- without one, the replica is marked stale (the router uses the approximate index for it) and is
  trusted again after `resync_s` of gap-free events.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import free_port
from kvlab.kvcache.events import AllBlocksCleared, BlockStored
from kvlab.kvcache.transport import EventPublisher
from kvlab.scenarios.faults import kv_event_gap

BS = 16
PROMPT = list(range(1000, 1000 + 12 * BS))


def _stored(block: int) -> BlockStored:
    parent = None if block == 0 else 10_000 + block - 1
    return BlockStored(block_hashes=[10_000 + block], parent_block_hash=parent,
                       token_ids=PROMPT[block * BS:(block + 1) * BS], block_size=BS)


@pytest.mark.parametrize("replay", [True, False])
def test_dropped_and_resumed_stream(replay):
    got = kv_event_gap(replay, resync_s=0.5)
    assert got["blocks_before"] == 4
    if replay:
        assert got["replayed"] >= 4 and got["gaps"] == 0 and got["state_after_gap"] == "live"
        assert got["blocks_after_gap"] >= 8 and got["stale_s"] == 0
    else:
        assert got["gaps"] == 1 and got["state_after_gap"] == "stale"
        assert got["blocks_after_gap"] == 0     # the lost prefix cannot be trusted
        assert got["stale_s"] >= 0.45           # trusted again only after resync_s of gap-free events


def test_replay_of_batches_the_publisher_no_longer_holds_is_refused():
    async def go():
        from kvlab.kvcache.transport import EventSubscriber
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        pub = EventPublisher(endpoint, bind=True, replay="tcp://127.0.0.1:*", buffer_steps=3)
        sub = EventSubscriber(endpoint, replay=pub.replay_endpoint)
        try:
            for b in range(6):
                pub.publish([_stored(b)])
            assert await sub.replay(1, 3) is None              # evicted from the buffer
            got = await sub.replay(3, 6)
            assert [g.seq for g in got] == [3, 4, 5]
            assert got[0].batch.events[0].block_hashes == [10_003]
        finally:
            sub.close()
            pub.close()
    asyncio.run(go())


@pytest.mark.parametrize("replay", [True, False])
def test_a_late_subscriber_catches_up_on_the_blocks_stored_before_it_joined(replay):
    """A gateway started beside a busy replica (or one whose subscription reached the publisher
    late: ZMQ's slow joiner) hears a chain's later blocks without their parents. With a replay
    endpoint the feed first applies what the replica still holds, so the whole chain is known;
    without one the children cannot be placed and nothing is."""
    async def go():
        from kvlab.contract import Endpoint
        from kvlab.gateway.endpoints import Backend
        from kvlab.gateway.kvevents import EventFeed
        from kvlab.kvcache.hashing import block_keys
        from kvlab.kvcache.index import ApproximateIndex, PreciseIndex

        endpoint = f"tcp://127.0.0.1:{free_port()}"
        pub = EventPublisher(endpoint, bind=True, replay="tcp://127.0.0.1:*" if replay else None)
        for b in range(4):                      # before anyone listens
            pub.publish([_stored(b)])
        precise = PreciseIndex()
        r = Backend(Endpoint(name="a", url="http://x", kv_events=endpoint, kv_replay=pub.replay_endpoint))
        task = asyncio.create_task(EventFeed(precise, ApproximateIndex()).run(r))
        try:
            for _ in range(200):                # until the subscriber hears the chain's next block
                pub.publish([_stored(4)])
                await asyncio.sleep(0.025)
                if r.events_state == "live":
                    break
            assert r.events_state == "live"
            return precise.match({BS: block_keys(PROMPT, BS)}, {"a": BS})["a"] // BS, r.events_replayed
        finally:
            task.cancel()
            pub.close()
    known, replayed = asyncio.run(go())
    if replay:
        assert known == 5 and replayed >= 4
    else:
        assert known == 0 and replayed == 0


def test_the_catch_up_keeps_what_this_gateway_routed_while_its_feed_was_connecting():
    """Lab 10 once split its hot group: a fresh gateway routed the group's first requests to a
    replica while that replica's feed was still connecting, the feed then went live on a catch-up
    holding only the reset from before the phase, and the replica's blocks were still on their way:
    for that moment the precise index showed it empty, and a tie sent the group elsewhere too. The
    routed blocks are speculative from the first route, and the replayed reset leaves them."""
    async def go():
        from kvlab.contract import Endpoint
        from kvlab.gateway.endpoints import Backend
        from kvlab.gateway.kvevents import EventFeed
        from kvlab.kvcache.hashing import block_keys
        from kvlab.kvcache.index import ApproximateIndex, PreciseIndex

        endpoint = f"tcp://127.0.0.1:{free_port()}"
        pub = EventPublisher(endpoint, bind=True, replay="tcp://127.0.0.1:*")
        pub.publish([AllBlocksCleared()])         # the phase's reset, before the gateway listens
        precise = PreciseIndex(speculative_ttl_s=30.0)    # the gateway's default TTL
        keys = {BS: block_keys(PROMPT, BS)}
        precise.speculate("a", keys[BS][:6])      # routed there while the feed was connecting
        r = Backend(Endpoint(name="a", url="http://x", kv_events=endpoint, kv_replay=pub.replay_endpoint))
        task = asyncio.create_task(EventFeed(precise, ApproximateIndex()).run(r))
        other = [BlockStored(block_hashes=[99], parent_block_hash=None, token_ids=list(range(BS)), block_size=BS)]
        try:
            for _ in range(200):                  # an unrelated batch, until the feed hears one
                pub.publish(other)
                await asyncio.sleep(0.025)
                if r.events_state == "live":
                    break
            assert r.events_state == "live" and r.events_replayed >= 1
            return precise.match(keys, {"a": BS})["a"] // BS
        finally:
            task.cancel()
            pub.close()
    assert asyncio.run(go()) == 6


def test_a_replica_routed_to_before_its_feed_is_live_is_not_empty_once_it_is():
    """The router's half of the same: a prompt routed while the replica's feed is still connecting
    (so looked up in the approximate index) is speculative on the precise index too, and counts
    there the moment the feed goes live, before the engine's BlockStored arrives."""
    from kvlab.contract import Endpoint
    from kvlab.gateway.config import load_policy
    from kvlab.gateway.endpoints import Registry
    from kvlab.gateway.router import Router
    from kvlab.gateway.scheduler import presets
    from kvlab.kvcache.index import ApproximateIndex, PreciseIndex

    cfg = load_policy("kv-aware-affinity")
    reg = Registry()
    reg.update([Endpoint(name=n, url=f"http://{n}") for n in ("a", "b", "c")])
    for r in reg.replicas.values():
        r.events_state, r.block_size = "connecting", BS
    router = Router(cfg, reg, PreciseIndex(cfg.index.speculative_ttl_s), ApproximateIndex(), presets.build(cfg))
    first = router.route(PROMPT).decision.chosen.name
    for r in reg.replicas.values():
        r.events_state = "live"                    # every feed live, no block stored yet
    d = router.route(PROMPT).decision
    assert d.chosen.name == first
    assert {c.name: c.prefix_tokens for c in d.candidates}[first] == (len(PROMPT) - 1) // BS * BS
