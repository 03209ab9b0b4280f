"""Chained token-block hashing.

A block's key is a hash of its parent's key and its own token ids, so equal keys mean equal
prefixes. Only full blocks are hashed (engines cache only full blocks). The gateway keys its
index with these hashes for requests *and* for `BlockStored.token_ids`, so it never depends on
an engine's hash function or seed; the simulator uses the same function with its own seed as
its "engine" hash.

The hash is CPython's tuple hash (xxHash-based, deterministic for ints in every process of the
same Python): 3x faster than blake2b here (0.22 ms vs 0.62 ms for 512 blocks of 16), and keys
never leave the process that computed them, so cross-version stability is not needed. Keys are
unsigned 64-bit ints, as vLLM's block hashes are on the wire (`ExternalBlockHash`), so an engine
hashing with the gateway's family publishes the gateway's own keys (the twin's engines do).
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT = 0  # the parent key of a sequence's first block
U64 = (1 << 64) - 1


def block_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT, seed: int = 0) -> list[int]:
    """Keys of every full block of `tokens`, each chained to the one before it.

    `parent` continues a chain (the key of the block before `tokens[0]`); `seed` separates hash
    families (the simulator's engine hashes vs the gateway's keys).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[int] = []
    append = keys.append
    # a family's chain starts from its own root; a given parent already belongs to the family
    prev = hash((seed, ROOT)) & U64 if seed and parent == ROOT else parent
    it = iter(tokens)
    # the full blocks, cut in C (a third faster than slicing); each hashed as the pair (parent, block),
    # its tokens not copied into a new tuple (850 blocks of 16: 0.23 ms, against 0.33 hashed flat)
    for block in zip(*[it] * block_size):
        prev = hash((prev, block)) & U64
        append(prev)
    return keys


def continue_keys(keys: list[int], tokens: Sequence[int], block_size: int) -> list[int]:
    """`keys`, the keys of the first full blocks of `tokens`, extended in place to every full block
    (the rest chained on from the last of them)."""
    keys.extend(block_keys(tokens[len(keys) * block_size:], block_size, keys[-1] if keys else ROOT))
    return keys
