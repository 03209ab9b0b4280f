"""The block pool's free queue: free blocks in LRU order, as a list read from its head.

vLLM keeps free blocks in a doubly linked list; an OrderedDict is the same in Python, with a
hash-table entry and a list node for every free block. Here a request's freed blocks are appended
to a list and allocation advances a head over it. A free block reused (a prefix-cache hit) stays
in the list and is only counted as stale: a block's entries before its last are stale, and so is
its last one while it is in use, so reading the list in order, the first entries of a block with
stale ones counted are the ones to skip. A stretch read that holds no such block (57 % of them in
a 16 x 3,000 conversation run of the twin) is taken whole after one C-level pass over it. Freed
blocks holding nothing cached go to the front, on a stack, as the pool's OrderedDict order had
them. The same order as the OrderedDict in less memory (the twin at 128 replicas: a fifth less);
no faster (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, is_not, not_
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlab.engine.sim.blockpool import Block

_key = attrgetter("key")
_SPARE = 1024   # list entries read or stale before the list is compacted


class FreeQueue:
    """`len()` free blocks; `pop(n)` takes the `n` least recently freed (uncached ones first)."""

    __slots__ = ("_count", "_front", "_head", "_order", "_stale")

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._order: list[Block] = []   # cached free blocks, oldest first; [_head:] not yet read
        self._head = 0
        self._stale: dict[Block, int] = {}   # a block's stale entries in `_order[_head:]`, if any
        self._front = list(reversed(blocks))   # uncached free blocks; the last one is the next to go
        self._count = len(blocks)

    def __len__(self) -> int:
        return self._count

    def remove(self, block: Block) -> None:
        """A free cached block taken back by a request: its entry goes stale."""
        stale = self._stale
        stale[block] = stale.get(block, 0) + 1
        self._count -= 1

    def push(self, blocks: list[Block]) -> None:
        """Blocks just freed, in order: cached ones to the back, each uncached one to the front."""
        keys = list(map(_key, blocks))
        uncached = keys.count(None)
        if uncached == keys[:uncached].count(None):   # none, or they lead: a request's last block, partial
            if uncached:
                self._front.extend(blocks[:uncached])
                blocks = blocks[uncached:]
            if blocks:
                self._append(blocks)
        else:
            held = list(map(is_not, keys, repeat(None)))
            self._front.extend(compress(blocks, map(not_, held)))
            self._append(list(compress(blocks, held)))
        self._count += len(keys)

    def _append(self, blocks: list[Block]) -> None:
        order = self._order
        if len(order) - self._head > 2 * self._count + _SPARE:   # mostly stale: keep the live entries
            order = self._order = self._live(order[self._head:])
            self._head = 0
        order.extend(blocks)

    def _live(self, entries: list[Block]) -> list[Block]:
        """The live ones of `entries`, the next entries of the list in order, whose stale ones are
        forgotten (they are read now)."""
        stale = self._stale
        if not stale or stale.keys().isdisjoint(entries):
            return entries
        keep = [True] * len(entries)
        # lazily, entry by entry: a block whose stale entries were all read before this one is live
        for i in compress(range(len(entries)), map(stale.__contains__, entries)):
            block = entries[i]
            keep[i] = False
            n = stale.pop(block)
            if n > 1:
                stale[block] = n - 1
        return list(compress(entries, keep))

    def pop(self, n: int) -> list[Block]:
        """The `n` next blocks to reuse (the caller checked that `n` are free)."""
        front = self._front
        out = front[:-n - 1:-1] if front else []
        if out:
            del front[-len(out):]
        need = n - len(out)
        order, head = self._order, self._head
        while need:   # the next `need` entries, less the stale ones, until enough were live
            chunk = order[head:head + need]
            if not chunk:
                raise IndexError("pop from a free queue with too few blocks")
            live = self._live(chunk)
            out.extend(live)
            head += len(chunk)
            need -= len(live)
        if head > _SPARE and 2 * head > len(order):
            del order[:head]
            head = 0
        self._head = head
        self._count -= n
        return out
