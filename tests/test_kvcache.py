"""Block hashing and the KV-event wire format, over real ZMQ sockets."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvlab.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_batch_positional,
)
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.transport import EventPublisher, EventSubscriber


def test_chained_keys_identify_prefixes():
    a = list(range(100))
    b = list(range(48)) + [999] + list(range(49, 100))
    ka, kb = block_keys(a, 16), block_keys(b, 16)
    assert len(ka) == 6  # only full blocks
    assert ka[:3] == kb[:3] and ka[3] != kb[3]
    # a difference in block 3 changes every later key (chaining)
    assert all(x != y for x, y in zip(ka[3:], kb[3:]))
    # continuing a chain equals hashing the whole sequence
    assert block_keys(a[32:], 16, parent=ka[1]) == ka[2:]
    # seeds separate hash families, deterministically
    assert block_keys(a, 16, seed=7) != ka
    assert block_keys(a, 16, seed=7) == block_keys(a, 16, seed=7)
    with pytest.raises(ValueError):
        block_keys(a, 0)


def _batch() -> KVEventBatch:
    return KVEventBatch(ts=12.5, data_parallel_rank=1, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(32)),
                    block_size=16, medium="GPU"),
        BlockRemoved(block_hashes=[11]),
        AllBlocksCleared(),
    ])


def test_map_encoding_matches_recent_vllm():
    raw = msgspec.msgpack.decode(encode_batch(_batch()))
    assert raw["data_parallel_rank"] == 1 and raw["ts"] == 12.5
    assert [e["type"] for e in raw["events"]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert raw["events"][0]["token_ids"] == list(range(32))
    assert decode_batch(encode_batch(_batch())) == _batch()


def test_positional_encoding_decodes():
    raw = msgspec.msgpack.decode(encode_batch_positional(_batch()))
    assert raw[0] == 12.5 and raw[1][0][0] == "BlockStored"
    got = decode_batch(encode_batch_positional(_batch()))
    assert got.events[0].block_hashes == [11, 12] and got.events[0].token_ids == list(range(32))
    assert isinstance(got.events[1], BlockRemoved) and isinstance(got.events[2], AllBlocksCleared)
    assert got.data_parallel_rank == 1


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": "x"})])
def test_garbage_is_a_decode_error(payload):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_batch(payload)


def test_round_trip_over_zmq_with_gap_and_restart(port):
    async def run():
        pub = EventPublisher(f"tcp://127.0.0.1:{port}".replace("127.0.0.1", "*"), topic="kv")
        sub = EventSubscriber(f"tcp://127.0.0.1:{port}", topic="kv")
        try:
            # PUB/SUB drops messages until the subscription propagates: publish until one lands
            for _ in range(200):
                pub.publish([AllBlocksCleared()])
                try:
                    first = await asyncio.wait_for(sub.recv(), 0.05)
                    break
                except TimeoutError:
                    continue
            else:
                pytest.fail("subscriber never received a batch")
            await asyncio.sleep(0.05)
            while True:  # drain what was sent while we waited
                try:
                    await asyncio.wait_for(sub.recv(), 0.05)
                except TimeoutError:
                    break
            seq = pub.publish(_batch().events)
            got = await asyncio.wait_for(sub.recv(), 2)
            assert got.seq == seq and got.gap == 0 and not got.restarted
            assert got.batch.events[0].token_ids == list(range(32))
            pub._seq += 3  # three batches lost on the wire
            pub.publish([AllBlocksCleared()])
            got = await asyncio.wait_for(sub.recv(), 2)
            assert got.gap == 3
            pub._seq = 0  # the publisher restarted
            pub.publish([AllBlocksCleared()])
            got = await asyncio.wait_for(sub.recv(), 2)
            assert got.restarted
            assert first.batch.events == [AllBlocksCleared()]
        finally:
            pub.close()
            sub.close()

    asyncio.run(run())


def test_malformed_frames_are_skipped(port):
    import zmq

    async def run():
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.PUB)
        raw.bind(f"tcp://127.0.0.1:{port}")
        sub = EventSubscriber(f"tcp://127.0.0.1:{port}")
        try:
            good = (b"t", (5).to_bytes(8, "big"), encode_batch(_batch()))
            for _ in range(200):
                raw.send_multipart((b"t", b"short", b"x"))
                raw.send_multipart((b"t", (4).to_bytes(8, "big"), b"\xc1"))
                raw.send_multipart(good)
                try:
                    got = await asyncio.wait_for(sub.recv(), 0.05)
                    break
                except TimeoutError:
                    continue
            else:
                pytest.fail("no batch received")
            assert got.seq == 5 and sub.malformed >= 2
        finally:
            raw.close(0)
            sub.close()

    asyncio.run(run())
