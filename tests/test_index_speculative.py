"""The precise index's speculative layer: a routed prompt's blocks held provisionally until the
engine's BlockStored confirms them, dropped by BlockRemoved, AllBlocksCleared, replica removal
or expiry; lookups tell the confirmed part of a prefix from the speculative part."""

from __future__ import annotations

import random

from kvlab.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.index import PreciseIndex

BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def setup(ttl: float = 5.0):
    clock = Clock()
    rng = random.Random(7)
    prompt = [rng.randrange(3000) for _ in range(8 * BS + 3)]
    return PreciseIndex(speculative_ttl_s=ttl, clock=clock), clock, prompt, {BS: block_keys(prompt, BS)}


def split(idx: PreciseIndex, keys, sizes):
    total = idx.match(keys, sizes)
    confirmed = idx.match(keys, sizes, speculative=False)
    return {r: (total[r], total[r] - confirmed[r]) for r in sizes}   # (prefix, speculative part)


def test_speculative_insert_is_seen_and_told_apart_from_confirmed():
    idx, _, prompt, keys = setup()
    eh = block_keys(prompt, BS, seed=99)
    idx.apply("a", [BlockStored(block_hashes=eh[:2], parent_block_hash=None, token_ids=prompt[:2 * BS], block_size=BS)])
    assert idx.speculate("a", keys[BS]) == 6          # the 2 confirmed blocks are left alone
    assert idx.speculate("b", keys[BS]) == 8
    assert split(idx, keys, {"a": BS, "b": BS, "c": BS}) == {"a": (8 * BS, 6 * BS), "b": (8 * BS, 8 * BS), "c": (0, 0)}
    assert idx.speculative_blocks("a") == 6 and idx.blocks("a") == 2


def test_block_stored_confirms_speculative_blocks():
    idx, clock, prompt, keys = setup()
    idx.speculate("a", keys[BS])
    eh = block_keys(prompt, BS, seed=99)
    idx.apply("a", [BlockStored(block_hashes=eh[:5], parent_block_hash=None, token_ids=prompt[:5 * BS], block_size=BS)])
    assert split(idx, keys, {"a": BS}) == {"a": (8 * BS, 3 * BS)}
    assert idx.confirmed == 5 and idx.speculative_blocks("a") == 3
    clock.t += 60   # the rest expires; what the engine confirmed stays
    assert split(idx, keys, {"a": BS}) == {"a": (5 * BS, 0)}
    assert idx.expired == 3


def test_expiry_reclaims_memory_and_a_new_decision_refreshes_the_ttl():
    idx, clock, prompt, keys = setup(ttl=5.0)
    idx.speculate("a", keys[BS])
    clock.t += 3
    idx.speculate("a", keys[BS][:4])                  # a second request with the first 4 blocks
    clock.t += 3                                      # 6 s after the first, 3 s after the second
    assert split(idx, keys, {"a": BS}) == {"a": (4 * BS, 4 * BS)}
    clock.t += 3
    assert split(idx, keys, {"a": BS}) == {"a": (0, 0)}
    assert idx.speculative_blocks("a") == 0 and not idx.table.speculative


def test_removed_cleared_and_forgotten_replicas_drop_their_speculation():
    idx, _, prompt, keys = setup()
    eh = block_keys(prompt, BS, seed=99)
    idx.speculate("a", keys[BS])
    idx.apply("a", [BlockStored(block_hashes=eh[:8], parent_block_hash=None, token_ids=prompt[:8 * BS], block_size=BS),
                    BlockRemoved(block_hashes=[eh[3]])])
    assert split(idx, keys, {"a": BS}) == {"a": (3 * BS, 0)}   # removal cuts the prefix, nothing speculative revives it
    idx.speculate("b", keys[BS])
    idx.apply("b", [AllBlocksCleared()])
    assert split(idx, keys, {"b": BS}) == {"b": (0, 0)}
    idx.speculate("c", keys[BS])
    idx.remove("c")
    assert idx.match(keys, {"c": BS}) == {"c": 0}
    assert not idx.table.speculative


def test_ttl_zero_turns_the_layer_off():
    idx, _, _, keys = setup(ttl=0)
    assert idx.speculate("a", keys[BS]) == 0
    assert idx.match(keys, {"a": BS}) == {"a": 0}


def test_a_reset_replayed_from_before_the_routing_keeps_its_speculation():
    """A new subscriber's catch-up replays the engine's earlier batches, a reset among them, after
    this gateway has already routed there: that reset is older than the speculation and leaves it."""
    idx, _, _, keys = setup()
    idx.speculate("a", keys[BS][:8])
    idx.apply("a", [AllBlocksCleared()], keep_speculative=True)
    assert split(idx, keys, {"a": BS})["a"] == (8 * BS, 8 * BS)
    idx.apply("a", [AllBlocksCleared()])                       # a live reset: gone
    assert split(idx, keys, {"a": BS})["a"] == (0, 0)
