"""A KV-event stream that drops and resumes (the publisher unbinds, publishes into the void, binds
again; the subscriber reconnects by itself), over real ZMQ sockets:

- with a replay endpoint (vLLM's protocol; the simulator serves it too), the lost batches are
  fetched and applied, the replica's index never goes stale and holds every block;
- without one, the replica is marked stale (the router uses the approximate index for it) and is
  trusted again after `resync_s` of gap-free events.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import free_port
from kvlab.contract import Endpoint
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.kvevents import EventFeed
from kvlab.kvcache.events import BlockStored
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
from kvlab.kvcache.transport import EventPublisher

BS = 16
PROMPT = list(range(1000, 1000 + 12 * BS))
KEYS = {BS: block_keys(PROMPT, BS)}


def _stored(block: int) -> BlockStored:
    parent = None if block == 0 else 10_000 + block - 1
    return BlockStored(block_hashes=[10_000 + block], parent_block_hash=parent,
                       token_ids=PROMPT[block * BS:(block + 1) * BS], block_size=BS)


async def _until(cond, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.parametrize("replay", [True, False])
def test_dropped_and_resumed_stream(replay):
    async def go():
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        pub = EventPublisher(endpoint, bind=True, replay="tcp://127.0.0.1:*" if replay else None)
        precise, approx = PreciseIndex(), ApproximateIndex()
        feed = EventFeed(precise, approx, resync_s=0.5)
        r = Backend(Endpoint(name="a", url="http://x", kv_events=endpoint, kv_replay=pub.replay_endpoint))
        task = asyncio.create_task(feed.run(r))
        try:
            while r.events_state != "live":     # a slow joiner: publish until the subscriber hears it
                pub.publish([_stored(0)])
                await asyncio.sleep(0.05)
            for b in range(1, 4):
                pub.publish([_stored(b)])
            await _until(lambda: precise.match(KEYS, {"a": BS})["a"] == 4 * BS)
            # the stream drops: blocks 4-7 are published while nobody can hear them
            pub._sock.unbind(pub.endpoint)
            await asyncio.sleep(0.2)
            for b in range(4, 8):
                pub.publish([_stored(b)])
            pub._sock.bind(pub.endpoint)
            t_resumed = time.monotonic()
            b = 8
            while r.events_gaps + r.events_replayed == 0:   # until the subscriber has reconnected
                pub.publish([_stored(8 + b % 4)])    # blocks past the lost ones, never the prefix's start
                b += 1
                await asyncio.sleep(0.05)
                assert time.monotonic() - t_resumed < 5, "the subscriber never reconnected"
            if replay:
                assert r.events_replayed >= 4 and r.events_gaps == 0 and r.events_state == "live"
                assert precise.match(KEYS, {"a": BS})["a"] >= 8 * BS
            else:
                assert r.events_gaps == 1 and r.events_state == "stale"
                assert precise.match(KEYS, {"a": BS})["a"] == 0     # the lost prefix cannot be trusted
                t_stale = time.monotonic()
                while r.events_state != "live":
                    pub.publish([])
                    await asyncio.sleep(0.05)
                    assert time.monotonic() - t_stale < 3, "never resynchronised"
                assert time.monotonic() - t_stale >= 0.45
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()
    asyncio.run(go())


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
