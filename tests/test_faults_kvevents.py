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
from kvlab.kvcache.events import BlockStored
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
