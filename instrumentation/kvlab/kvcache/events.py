"""vLLM's KV-event wire format as typed msgspec structs.

A ZMQ message is three frames: topic, an 8-byte big-endian sequence number, and a msgpack
`KVEventBatch` (timestamp, events, data-parallel rank). Recent vLLM encodes a batch as a map
and each event as a map tagged by `"type"`; older vLLM encodes both positionally (arrays, the
event's tag first). `encode_batch` writes the recent form; `decode_batch` reads both.
Reference: `vllm/distributed/kv_events.py`.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = int | bytes  # vLLM sends 64-bit ints (older: bytes digests)


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three event kinds; the tag (`type`) is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # kvlab, experimental (docs/semantic-kv.md): each block's retention class, a trailing optional
    # key engines without typed retention never send and decoders that do not know it skip
    retention_classes: list[str] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# The older positional encoding: same fields, arrays instead of maps.
class _PosEvent(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class _PosBlockStored(_PosEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _PosBlockRemoved(_PosEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class _PosAllBlocksCleared(_PosEvent, tag="AllBlocksCleared"):
    pass


class _PosBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_PosBlockStored | _PosBlockRemoved | _PosAllBlocksCleared]
    data_parallel_rank: int | None = None


class _MixedBatch(KVEventBatch, array_like=True, gc=False):
    """What vLLM 0.32 sends (checked against its `EventBatch`): array batch, map events."""


_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_pos_decoder = msgspec.msgpack.Decoder(_PosBatch)
_mixed_decoder = msgspec.msgpack.Decoder(_MixedBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload recent vLLM publishes."""
    return _encoder.encode(batch)


def encode_batch_positional(batch: KVEventBatch) -> bytes:
    """The older positional payload (for tests and for replaying old captures)."""
    events: list[Any] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            events.append(["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                           ev.block_size, ev.lora_id, ev.medium])
        elif isinstance(ev, BlockRemoved):
            events.append(["BlockRemoved", ev.block_hashes, ev.medium])
        else:
            events.append(["AllBlocksCleared"])
    return _encoder.encode([batch.ts, events, batch.data_parallel_rank])


def _from_positional(pb: _PosBatch) -> KVEventBatch:
    events: list[Event] = []
    for ev in pb.events:
        if isinstance(ev, _PosBlockStored):
            events.append(BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                                      ev.block_size, ev.lora_id, ev.medium))
        elif isinstance(ev, _PosBlockRemoved):
            events.append(BlockRemoved(ev.block_hashes, ev.medium))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(pb.ts, events, pb.data_parallel_rank)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode either encoding; raises `msgspec.DecodeError` (a `ValueError`) on garbage."""
    if not payload:
        raise msgspec.DecodeError("empty KV-event payload")
    first = payload[0]
    # msgpack arrays: fixarray 0x90-0x9f, array16 0xdc, array32 0xdd
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        try:  # vLLM 0.32: the batch an array, each event a map tagged by "type"
            mb = _mixed_decoder.decode(payload)
            return KVEventBatch(mb.ts, mb.events, mb.data_parallel_rank)
        except msgspec.ValidationError:
            return _from_positional(_pos_decoder.decode(payload))
    return _map_decoder.decode(payload)
