"""The KV-cache block pool: fixed blocks, prefix caching with reference counts, LRU eviction.

Mirrors vLLM's v1 block pool. A block is *cached* once it is full of computed tokens: its chained
key (kvlab.kvcache.hashing) maps to it, and a later request with the same prefix reuses it
instead of recomputing. Blocks used by running requests (ref_cnt > 0) are never evicted; free
blocks sit in an LRU queue and a cached free block loses its identity only when allocation
reaches it. Two deliberate refinements: freed blocks that hold nothing cached go to the front of
the queue (reused first, so cached content lives longer), and a block whose key is already cached
elsewhere is not cached twice (so every BlockStored has exactly one BlockRemoved later).
Every change of cached content queues a vLLM KV event (`take_events`); a block's key is already
the unsigned 64-bit hash vLLM publishes (kvlab.kvcache.hashing).
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import compress, repeat, takewhile
from operator import attrgetter, is_not, not_, sub
from typing import cast

from kvlab.engine.sim.freequeue import FreeQueue
from kvlab.engine.sim.retention import CLASS_NAMES, NORMAL, ClassedFreeQueue
from kvlab.engine.sim.tier import CpuTier
from kvlab.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, ExternalBlockHash

_present = partial(is_not, None)
_key, _ref_cnt = attrgetter("key"), attrgetter("ref_cnt")


class Block:
    __slots__ = ("cls", "id", "key", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref_cnt = 0
        self.key: int | None = None
        self.cls = NORMAL          # retention class (retention.py); only a typed pool changes it

    def __repr__(self) -> str:
        return f"Block({self.id}, ref={self.ref_cnt}, key={self.key})"


def _blocks(n: int) -> list[Block]:
    """`n` new blocks, the cyclic collector paused: they hold no cycles, yet every 700 of them
    started a collection and a pool of 28,000 took 3.5 times as long (docs/benchmarks.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return [Block(i) for i in range(n)]
    finally:
        if enabled:
            gc.enable()


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens; `events=False` skips event bookkeeping;
    `pinned_share` (not None) makes the cache typed: retention classes order eviction."""

    def __init__(self, num_blocks: int, block_size: int, events: bool = True, cpu_blocks: int = 0,
                 pinned_share: float | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = _blocks(num_blocks)
        self.typed = ClassedFreeQueue(self.blocks, pinned_share) if pinned_share is not None else None
        self._free: FreeQueue | ClassedFreeQueue = self.typed if self.typed is not None else FreeQueue(self.blocks)
        self._cached: dict[int, Block] = {}
        self._events_on = events
        self._events: list[Event] = []
        # ---- CPU offload tier (tier.py): None without one --------------------------------
        self.tier = CpuTier(cpu_blocks, block_size, self.emit if events else None) if cpu_blocks else None

    # ---- state -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def is_cached(self, key: int) -> bool:
        return key in self._cached

    # ---- operations ------------------------------------------------------------------
    def cached_prefix(self, keys: Sequence[int]) -> list[Block]:
        """The cached blocks of the longest prefix of `keys` (not yet referenced)."""
        return cast(list[Block], list(takewhile(_present, map(self._cached.get, keys))))

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks a request reuses (they leave the free queue)."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                free.remove(block)
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block] | None:
        """`n` fresh blocks from the LRU end of the free queue, evicting what they cached;
        None (and no change) when fewer than `n` are free."""
        free = self._free
        if n > len(free):
            return None
        # a prompt's worth of blocks a call: taken, evicted and referenced in C-level passes
        out = free.pop(n)
        keys = list(map(_key, out))
        if keys.count(None) < n:
            held = list(map(is_not, keys, repeat(None)))
            evicted = list(compress(out, held))
            removed: list[int] = list(compress(keys, held))
            deque(map(self._cached.__delitem__, removed), maxlen=0)
            deque(map(setattr, evicted, repeat("key"), repeat(None)), maxlen=0)
            if self._events_on:
                self._events.append(BlockRemoved(block_hashes=cast(list[ExternalBlockHash], removed), medium="GPU"))
        deque(map(setattr, out, repeat("ref_cnt"), repeat(1)), maxlen=0)
        return out

    def cache(self, blocks: Sequence[Block], keys: Sequence[int], parent: int | None,
              token_ids: list[int], classes: Sequence[int] | None = None) -> None:
        """Mark fresh full blocks (allocated, not cached yet) as cached under `keys` (chained after
        `parent`), one BlockStored; `classes`: their retention classes (a typed pool)."""
        # each key cached under its block unless another block holds the same content already
        cached = self._cached
        before = len(cached)
        deque(map(cached.setdefault, keys, blocks), maxlen=0)
        if len(blocks) == len(keys) == len(cached) - before:   # every key new: the usual case, in C
            stored: list[int] = list(keys)
            deque(map(setattr, blocks, repeat("key"), stored), maxlen=0)
        else:
            stored = []
            for block, key, holder in zip(blocks, keys, map(cached.get, keys)):
                if holder is block:
                    block.key = key
                    stored.append(key)
        if classes is not None:
            self.classify(blocks, classes)
        if stored and self._events_on:
            if len(stored) != len(keys):  # partial: publish only what was stored, each chained
                self._store_each(blocks, keys, parent, token_ids)
            else:
                self._events.append(BlockStored(
                    block_hashes=cast(list[ExternalBlockHash], stored), parent_block_hash=parent,
                    token_ids=token_ids, block_size=self.block_size, medium="GPU",
                    retention_classes=self._class_names(blocks)))
        if self.tier is not None:  # offloaded on compute (tier.py)
            self.tier.store(keys, parent, token_ids)

    def _store_each(self, blocks: Sequence[Block], keys: Sequence[int], parent: int | None,
                    token_ids: list[int]) -> None:
        bs = self.block_size
        for i, (block, key) in enumerate(zip(blocks, keys)):
            if block.key == key:
                self._events.append(BlockStored(
                    block_hashes=[key], parent_block_hash=parent,
                    token_ids=token_ids[i * bs:(i + 1) * bs], block_size=bs, medium="GPU",
                    retention_classes=self._class_names([block])))
            parent = key

    # ---- retention classes (a typed pool; engine/sim/retention.py) ---------------------
    def classify(self, blocks: Sequence[Block], classes: Sequence[int]) -> None:
        """Set the retention class of cached blocks (the latest request's directive wins)."""
        if self.typed is not None:
            for block, cls in zip(blocks, classes):
                if block.key is not None:
                    self.typed.set_class(block, cls)

    def _class_names(self, blocks: Sequence[Block]) -> list[str] | None:
        return None if self.typed is None else [CLASS_NAMES[b.cls] for b in blocks]

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference on each block; pass a request's blocks tail first (as vLLM does) so
        a prompt's last blocks are evicted before its shared first ones."""
        # in C-level passes: the same queue as freeing one block at a time in this order
        blocks = list(blocks)
        refs = list(map(sub, map(_ref_cnt, blocks), repeat(1)))
        deque(map(setattr, blocks, repeat("ref_cnt"), refs), maxlen=0)
        unused = refs.count(0)
        if unused == refs[:unused].count(0):   # none, or they come first: the still shared ones (a prompt's first) last
            if unused:
                self._free.push(blocks[:unused])
        else:
            self._free.push(list(compress(blocks, map(not_, refs))))

    def reset(self) -> None:
        """Forget every cached block (running requests keep their blocks); AllBlocksCleared."""
        for block in self._cached.values():
            block.key = None
            if self.typed is not None:
                self.typed.set_class(block, NORMAL)
        self._cached.clear()
        if self.tier is not None:
            self.tier.reset()
        if self._events_on:
            self._events.append(AllBlocksCleared())

    def emit(self, event: Event) -> None:
        """Queue an event from another part of the cache (the CPU tier), in order."""
        self._events.append(event)

    def take_events(self) -> list[Event]:
        """The events queued since the last call, in order."""
        events, self._events = self._events, []
        return events
