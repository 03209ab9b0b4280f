"""The block pool's free queue: free blocks in LRU order, as a list read from its head.

vLLM keeps free blocks in a doubly linked list; an OrderedDict is the same in Python, with a
hash-table entry and a list node for every free block. Here a request's freed blocks are appended
to a list, allocation advances a head over it, and a free block reused (a prefix-cache hit) is
only marked: `Block.at` is the list position of its one live entry, so a reused block's old entry
no longer matches and allocation skips it. Freed blocks holding nothing cached go to the front, on
a stack, as the pool's OrderedDict order had them. The same order in less memory (the twin at 128
replicas: a fifth less); no faster (docs/benchmarks.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, eq, is_, is_not
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlab.engine.sim.blockpool import Block

_key, _at = attrgetter("key"), attrgetter("at")
_SPARE = 1024   # list entries read or stale before the list is compacted


class FreeQueue:
    """`len()` free blocks; `pop(n)` takes the `n` least recently freed (uncached ones first)."""

    __slots__ = ("_count", "_front", "_head", "_order", "_origin")

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._order: list[Block] = []   # cached free blocks, oldest first; [_head:] not yet read
        self._origin = 0                # the position of `_order[0]` (positions only grow)
        self._head = 0
        self._front = list(reversed(blocks))   # uncached free blocks; the last one is the next to go
        self._count = len(blocks)

    def __len__(self) -> int:
        return self._count

    def remove(self, block: Block) -> None:
        """A free cached block taken back by a request: its entry goes stale."""
        block.at = -1
        self._count -= 1

    def push(self, blocks: list[Block]) -> None:
        """Blocks just freed, in order: cached ones to the back, each uncached one to the front."""
        uncached = list(compress(blocks, map(is_, map(_key, blocks), repeat(None))))
        if uncached:
            self._front.extend(uncached)
            if len(uncached) < len(blocks):
                self._append(list(compress(blocks, map(is_not, map(_key, blocks), repeat(None)))))
        else:
            self._append(blocks)
        self._count += len(blocks)

    def _append(self, blocks: list[Block]) -> None:
        order = self._order
        if len(order) - self._head > 2 * self._count + _SPARE:   # mostly stale: keep the live entries
            live = self._live(order[self._head:], self._head)
            self._origin += len(order)
            order = self._order = live
            self._head = 0
            self._place(live, 0)
        self._place(blocks, len(order))
        order.extend(blocks)

    def _place(self, blocks: list[Block], index: int) -> None:
        start = self._origin + index
        deque(map(setattr, blocks, repeat("at"), range(start, start + len(blocks))), maxlen=0)

    def _live(self, entries: list[Block], index: int) -> list[Block]:
        """The entries still current among `entries`, which sit at `index` in the list."""
        start = self._origin + index
        return list(compress(entries, map(eq, map(_at, entries), range(start, start + len(entries)))))

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
            live = self._live(chunk, head)
            out.extend(live)
            head += len(chunk)
            need -= len(live)
        if head > _SPARE and 2 * head > len(order):
            del order[:head]
            self._origin += head
            head = 0
        self._head = head
        self._count -= n
        return out
