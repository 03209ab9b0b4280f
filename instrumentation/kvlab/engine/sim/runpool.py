"""A block pool on key runs, for the twin: `BlockPool`'s calls and answers, a block known by its key.

A twin engine's blocks are interchangeable but for the key each caches, and a trace prompt's keys
ascend in runs (keys.py), so what `BlockPool` does block by block is done here run by run:

- reference counts are a map from key intervals to counts (no entry: not cached);
- the free queue's cached blocks are key segments in LRU order, each freed tail first (so its
  keys descend), with a map of stale entries per key interval (a free block taken back by a hit
  leaves its entry behind, as `FreeQueue` counts them);
- a block that caches nothing is anonymous: the free ones are a count (they go first, as the
  queue's front does), a request's are its block count less its keyed runs.

A request's blocks are a `Held`: how many, and its keyed ones as runs of positions and keys. The
scheduler and the P/D transfer use it as they use a list of blocks (its length, `+`, `extend`,
`reversed`, a slice to cache, a block's key). The same evictions, the same KV events, the same
answers as `BlockPool` (tests/test_sim_runpool.py drives both with the same calls); untyped, with no
CPU tier: the twin uses it where those hold and the keys ascend (twin/replica.py).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import compress, count
from operator import itemgetter, ne
from typing import cast

from kvlab.kvcache.events import BlockRemoved, BlockStored, Event, ExternalBlockHash
from kvlab.kvcache.intervals import Intervals, Runs, runs
from kvlab.kvcache.runkeys import RunKeys

_pos = itemgetter(0)


def key_runs(keys: Sequence[int], bound: int) -> Runs:
    """Runs of consecutive keys, in the keys' order, none across `bound`: by binary searches where
    they ascend (a trace prompt's), one pass otherwise (a prompt continued over hashed blocks)."""
    out: Runs
    if isinstance(keys, RunKeys):   # a trace prompt's: runs already
        out = keys.runs
    elif len(keys) < 8:   # an answer's blocks, a few a step: a loop is cheaper than the passes below
        out = []
        for k in keys:
            if out and out[-1][1] == k:
                out[-1] = (out[-1][0], k + 1)
            else:
                out.append((k, k + 1))
    elif sorted(keys) == keys:
        out = runs(keys)
    else:
        n = len(keys)
        cuts = [0, *compress(count(1), map(ne, keys[1:], [k + 1 for k in keys[:-1]])), n]
        out = [(keys[a], keys[a] + b - a) for a, b in zip(cuts, cuts[1:])]
    if any(a < bound < b for a, b in out):
        out = [piece for a, b in out for piece in (((a, bound), (bound, b)) if a < bound < b else ((a, b),))]
    return out


class Slot:
    """One block of a `Held`: its key, None when anonymous."""

    __slots__ = ("key",)

    def __init__(self, key: int | None) -> None:
        self.key = key


_ANONYMOUS = Slot(None)


class Held:
    """A request's `n` blocks; `runs`: its keyed ones as (position, first key, end key), in order."""

    __slots__ = ("n", "runs")

    def __init__(self, n: int = 0, runs: list[tuple[int, int, int]] | None = None) -> None:
        self.n = n
        self.runs = runs if runs is not None else []

    def __len__(self) -> int:
        return self.n

    def __add__(self, other: Held) -> Held:
        out = Held(self.n, self.runs[:])
        out.extend(other)
        return out

    def extend(self, other: Held) -> None:
        if other.runs:   # fresh blocks (the usual case) are anonymous
            n = self.n
            self.runs.extend((p + n, a, b) for p, a, b in other.runs)
        self.n += other.n

    def __reversed__(self) -> Freed:
        return Freed(self)

    def __getitem__(self, i: int | slice) -> Slot | Span:
        if isinstance(i, slice):
            start, stop, _ = i.indices(self.n)
            return Span(self, start, stop)
        runs = self.runs
        if not runs or i >= runs[-1][0] + runs[-1][2] - runs[-1][1]:   # past the keyed ones: a fresh block
            return _ANONYMOUS
        j = bisect_right(runs, i, key=_pos) - 1
        if j >= 0:
            p, a, b = runs[j]
            if i < p + b - a:
                return Slot(a + i - p)
        return _ANONYMOUS

    def keyed(self) -> int:
        return sum(b - a for _, a, b in self.runs)


class Span:
    """Positions `start` to `stop` (excluded) of a `Held`: blocks to cache."""

    __slots__ = ("held", "start", "stop")

    def __init__(self, held: Held, start: int, stop: int) -> None:
        self.held, self.start, self.stop = held, start, stop

    def __len__(self) -> int:
        return self.stop - self.start


class Freed:
    """A `Held` passed tail first, to be freed."""

    __slots__ = ("held",)

    def __init__(self, held: Held) -> None:
        self.held = held


class RunPool:
    """`num_blocks` blocks of `block_size` tokens, kept by key runs below `bound` (a trace's
    structural keys) and key by key from it up (hashed blocks: an answer's, scattered over 64 bits,
    would cut the maps into pieces); `events=False` skips the KV events."""

    tier = None    # no CPU tier
    typed = None   # no retention classes

    def __init__(self, num_blocks: int, block_size: int, events: bool = True, bound: int = 1 << 62) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bound = bound
        self._ref: Intervals[int | None] = Intervals(None)   # key -> reference count; None: not cached
        self._stale: Intervals[int] = Intervals(0)   # key -> its stale entries in the LRU
        self._hashed: dict[int, int] = {}         # the same for keys from `bound` up
        self._hashed_stale: dict[int, int] = {}
        self._lru: deque[tuple[int, int]] = deque()   # (first, end): keys end - 1 down to first, oldest first
        self._anon = num_blocks    # free blocks that cache nothing
        self._free_cached = 0      # free blocks that cache a key (live in the LRU)
        self._cached = 0
        self._events_on = events
        self._events: list[Event] = []
        # the KV events leave out the keys from here up, which no one reads (the twin's index keeps
        # no block from its `unread_from` up: kvcache/index.py); above every key: all reported
        self.quiet = 1 << 64

    # ---- state -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._anon + self._free_cached

    @property
    def num_cached(self) -> int:
        return self._cached

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def is_cached(self, key: int) -> bool:
        return key in self._hashed if key >= self.bound else self._ref.at(key) is not None

    # ---- operations ------------------------------------------------------------------
    def cached_prefix(self, keys: Sequence[int]) -> Held:
        """The cached blocks of the longest prefix of `keys` (not yet referenced)."""
        starts, refs, bound, hashed = self._ref.starts, self._ref.values, self.bound, self._hashed
        last = len(starts) - 1
        out: list[tuple[int, int, int]] = []
        pos = 0
        for first, end in key_runs(keys, bound):
            at = first
            if first >= bound:
                while at < end and at in hashed:
                    at += 1
            else:
                i = bisect_right(starts, first) - 1
                while at < end and refs[i] is not None:
                    at = starts[i + 1] if i < last else end
                    i += 1
                at = min(at, end)
            if at > first:
                out.append((pos, first, at))
                pos += at - first
            if at < end:
                break
        return Held(pos, out)

    def touch(self, blocks: Held) -> None:
        """Take a reference on cached blocks a request reuses (they leave the free queue)."""
        ref, stale, bound = self._ref, self._stale, self.bound
        for _, first, end in blocks.runs:
            if first >= bound:
                hashed, hashed_stale = self._hashed, self._hashed_stale
                for k in range(first, end):
                    v = hashed[k]
                    if not v:
                        hashed_stale[k] = hashed_stale.get(k, 0) + 1
                        self._free_cached -= 1
                    hashed[k] = v + 1
                continue
            i, j = ref.span(first, end)
            refs = cast(list[int], ref.values[i:j])
            taken = [(a, b) for a, b, v in zip(ref.starts[i:j], ref.starts[i + 1:j + 1], refs) if v == 0]
            ref.put(i, j, [v + 1 for v in refs])
            for a, b in taken:   # their LRU entries go stale
                k, m = stale.span(a, b)
                stale.put(k, m, [v + 1 for v in stale.values[k:m]])
                self._free_cached -= b - a

    def allocate(self, n: int) -> Held | None:
        """`n` fresh blocks, the anonymous free ones first, then the LRU's, evicting what they
        cached; None (and no change) when fewer than `n` are free."""
        if n > self._anon + self._free_cached:
            return None
        take = min(n, self._anon)
        self._anon -= take
        if n > take:
            removed = self._evict(n - take)
            if self._events_on and removed:
                self._events.append(BlockRemoved(block_hashes=cast(list[ExternalBlockHash], removed), medium="GPU"))
        return Held(n)

    def _evict(self, n: int) -> list[int]:
        """Read the LRU from its oldest entry until `n` live ones were read (a stale one is
        skipped, its count read down); their keys leave the cache, in the order read (those below
        `quiet` returned)."""
        self._free_cached -= n
        self._cached -= n
        lru, stale, bound, quiet = self._lru, self._stale, self.bound, self.quiet
        starts, counts = stale.starts, stale.values
        hashed, hashed_stale = self._hashed, self._hashed_stale
        removed: list[int] = []
        gone: Runs = []
        while n:
            first, end = lru[0]
            top = end   # reading down from end - 1
            if first >= bound:
                while top > first and n:
                    top -= 1
                    v = hashed_stale.pop(top, 0)
                    if v:
                        if v > 1:
                            hashed_stale[top] = v - 1
                    else:
                        del hashed[top]
                        if top < quiet:
                            removed.append(top)
                        n -= 1
            else:
                while top > first and n:
                    i = bisect_right(starts, top - 1) - 1
                    low = max(starts[i], first)
                    if counts[i]:   # each key's entry here read: one stale entry fewer
                        k, m = stale.span(low, top)
                        stale.put(k, m, [v - 1 for v in counts[k:m]])
                    else:
                        low = max(low, top - n)
                        removed.extend(range(min(top, quiet) - 1, low - 1, -1))
                        gone.append((low, top))
                        n -= top - low
                    top = low
            if top > first:
                lru[0] = (first, top)
            else:
                lru.popleft()
        ref = self._ref
        for a, b in gone:
            ref.fill(a, b, None)
        return removed

    def cache(self, blocks: Held | Span, keys: Sequence[int], parent: int | None,
              token_ids: list[int], classes: Sequence[int] | None = None) -> None:
        """Mark fresh full blocks (allocated, not cached yet) as cached under `keys` (chained after
        `parent`), one BlockStored; a key already cached stays with its block, and this one
        anonymous."""
        held, at = (blocks.held, blocks.start) if isinstance(blocks, Span) else (blocks, 0)
        if isinstance(keys, RunKeys) and len(keys.runs) == 1 and self._extend(held, at, *keys.runs[0]):
            return
        ref, bound, hashed = self._ref, self.bound, self._hashed
        stored: list[tuple[int, int, int]] = []
        for first, end in key_runs(keys, bound):
            if first >= bound:
                for k in range(first, end):
                    if k not in hashed:
                        hashed[k] = 1
                        stored.append((at + k - first, k, k + 1))
            else:
                i, j = ref.span(first, end)
                refs = ref.values[i:j]
                stored.extend((at + a - first, a, b) for a, b, v in zip(ref.starts[i:j], ref.starts[i + 1:j + 1], refs)
                              if v is None)
                ref.put(i, j, [1 if v is None else v for v in refs])
            at += end - first
        if not stored:
            return
        n = sum(b - a for _, a, b in stored)
        self._cached += n
        mine = held.runs
        for p, a, b in stored:
            if mine and mine[-1][0] > p:   # before blocks cached already (the scheduler caches in order)
                insort(mine, (p, a, b), key=_pos)
            elif mine and mine[-1][2] == a != bound and mine[-1][0] + a - mine[-1][1] == p:
                q, f, _ = mine[-1]
                mine[-1] = (q, f, b)
            else:
                mine.append((p, a, b))
        if not self._events_on or keys[0] >= self.quiet:   # (a prompt's quiet keys come after its others)
            return
        if n == len(keys):
            self._events.append(BlockStored(
                block_hashes=cast(list[ExternalBlockHash], keys[:]), parent_block_hash=parent,
                token_ids=token_ids, block_size=self.block_size, medium="GPU"))
            return
        # partial: each stored block its own event, chained to the key before it (BlockPool's)
        new = {k for _, a, b in stored for k in range(a, b)}
        bs = self.block_size
        for i, key in enumerate(keys):
            if key in new and key < self.quiet:
                self._events.append(BlockStored(
                    block_hashes=[key], parent_block_hash=parent, token_ids=token_ids[i * bs:(i + 1) * bs],
                    block_size=bs, medium="GPU"))
            parent = key

    def _extend(self, held: Held, at: int, first: int, end: int) -> bool:
        """`cache` where an answer's next blocks (twin/keys.py `AnswerKeys`) go on from the keys of
        the request's blocks before them, which it alone holds, with no one else's keys up to `end`
        and no KV event: one interval's start moves (False, and no change, in any other case)."""
        mine = held.runs
        if not mine or end > self.bound or (self._events_on and first < self.quiet):
            return False
        p, a, b = mine[-1]
        if b != first or p + b - a != at:
            return False
        starts, values = self._ref.starts, self._ref.values
        i = bisect_right(starts, first) - 1
        if starts[i] != first or values[i] is not None or values[i - 1] != 1 or \
                (i + 1 < len(starts) and starts[i + 1] <= end):
            return False
        starts[i] = end
        mine[-1] = (p, a, end)
        self._cached += end - first
        return True

    def free(self, blocks: Freed | Iterable[object]) -> None:
        """Drop a reference on each block of a `Held` passed `reversed` (tail first): the
        anonymous ones go first in the free queue, the keyed ones whose count falls to 0 to its
        back, their keys descending."""
        if not isinstance(blocks, Freed):
            if next(iter(blocks), None) is not None:   # a request's blocks before it held any: []
                raise TypeError("a run pool frees the blocks it handed out")
            return
        held = blocks.held
        ref, lru, bound, hashed = self._ref, self._lru, self.bound, self._hashed
        self._anon += held.n - held.keyed()
        for _, first, end in reversed(held.runs):
            if first >= bound:
                for k in range(end - 1, first - 1, -1):
                    v = hashed[k] - 1
                    hashed[k] = v
                    if not v:
                        self._free_cached += 1
                        if lru and lru[-1][0] == k + 1 and k + 1 != bound:
                            lru[-1] = (k, lru[-1][1])
                        else:
                            lru.append((k, k + 1))
                continue
            i, j = ref.span(first, end)
            refs = cast(list[int], ref.values[i:j])
            bounds = ref.starts[i:j + 1]
            ref.put(i, j, [v - 1 for v in refs])
            for k in range(j - i - 1, -1, -1):
                if refs[k] == 1:
                    a, b = bounds[k], bounds[k + 1]
                    self._free_cached += b - a
                    if lru and lru[-1][0] == b and b != bound:
                        lru[-1] = (a, lru[-1][1])
                    else:
                        lru.append((a, b))

    def reset(self) -> None:
        raise NotImplementedError("a run pool is never reset (the twin does not)")

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events
