"""The precise index on intervals of keys, for keys that come in ascending runs (the twin's).

The twin keys a trace prompt's blocks by its structure (twin/keys.py): a prompt's keys ascend,
and most come in runs of consecutive integers (a prompt of 759 blocks in 3.6 runs on average, in
the conversation trace). `PreciseIndex` then does per block what here is done per run: one map
from disjoint key intervals to the replicas holding them (confirmed bits, and the speculative ones
`width` bits higher), and per replica its speculated intervals with their expiry. A lookup walks
the intervals its runs cross, not its blocks.

Same answers as `PreciseIndex` with `engine_keys` (the twin's engines hash with the gateway's
family), for GPU blocks with no retention class: the twin uses it where those hold and the keys
ascend, `PreciseIndex` elsewhere (twin/gateway.py); tests/test_kvcache_intervals.py drives both
with the same calls.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from operator import and_, or_
from typing import Generic, TypeVar, cast

from kvlab.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvlab.kvcache.runkeys import RunKeys

Runs = list[tuple[int, int]]   # (first key, one past the last), in the keys' order
V = TypeVar("V")


def runs(keys: Sequence[int]) -> Runs:
    """The runs of consecutive integers in ascending `keys` (a `RunKeys`' own): where a run goes
    on, a key less its place stays the same, and from one run to the next it grows, so each run's
    end is a binary search away."""
    if isinstance(keys, RunKeys):
        return keys.runs
    n = len(keys)
    if not n:
        return []
    if keys[-1] - keys[0] == n - 1:
        return [(keys[0], keys[-1] + 1)]
    out: Runs = []
    at = range(n)
    i = 0
    while i < n:
        first = keys[i]
        off = first - i
        j = bisect_right(at, 0, i + 1, n, key=lambda k: keys[k] - k - off)
        out.append((first, first + j - i))
        i = j
    return out


class Intervals(Generic[V]):
    """A map from every integer to a value, kept as disjoint intervals: interval `i` is the keys
    from `starts[i]` up to the next start; the first starts below every key."""

    def __init__(self, empty: V) -> None:
        self.starts: list[int] = [-1]
        self.values: list[V] = [empty]

    def at(self, key: int) -> V:
        return self.values[bisect_right(self.starts, key) - 1]

    def cut(self, key: int) -> int:
        """The interval starting at `key`, split off from the one holding it if need be."""
        starts = self.starts
        i = bisect_right(starts, key)
        if starts[i - 1] == key:
            return i - 1
        starts.insert(i, key)
        self.values.insert(i, self.values[i - 1])
        return i

    def span(self, first: int, end: int) -> tuple[int, int]:
        """The intervals `i` to `j` (excluded) that hold exactly the keys `first` to `end` (excluded)."""
        return self.cut(first), self.cut(end)

    def put(self, i: int, j: int, values: list[V]) -> None:
        """Intervals `i` to `j` (excluded) take `values`; neighbours of equal value are merged."""
        starts, old = self.starts, self.values
        last = old[i - 1]
        keep_s: list[int] = []
        keep_v: list[V] = []
        for s, v in zip(starts[i:j + 1], values + old[j:j + 1]):
            if v != last:
                keep_s.append(s)
                keep_v.append(v)
                last = v
        starts[i:j + 1] = keep_s
        old[i:j + 1] = keep_v

    def fill(self, first: int, end: int, value: V) -> None:
        """The keys `first` to `end` (excluded) take `value`; where they end an interval and the
        next one holds `value` (an LRU's oldest keys evicted, from the top down), that one's start
        moves down, with no interval cut and merged again."""
        starts, values = self.starts, self.values
        i = bisect_right(starts, first)
        if i < len(starts) and starts[i] == end and values[i] == value and starts[i - 1] < first:
            starts[i] = first
            return
        i, j = self.span(first, end)
        self.put(i, j, [value] * (j - i))

    def lengths(self, i: int, j: int, end: int) -> list[int]:
        """How many keys each of intervals `i` to `j` (excluded) holds, the last ending at `end`."""
        starts = self.starts
        return [b - a for a, b in zip(starts[i:j], starts[i + 1:j] + [end])]


class IntervalIndex:
    """`PreciseIndex`'s calls and answers (engine keys, GPU blocks, untyped) on key intervals, for
    up to `width` replicas."""

    def __init__(self, width: int, speculative_ttl_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.width = width
        self.table: Intervals[int] = Intervals(0)   # key -> confirmed bits | speculative bits << width
        self.unread_from: int | None = None   # as PreciseIndex.unread_from
        self.block_size: dict[str, int] = {}
        self.unresolved = 0
        self.speculative_ttl_s = speculative_ttl_s
        self._clock = clock
        self.confirmed = 0
        self.expired = 0
        self._bits: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free: list[int] = []
        self._held: dict[str, int] = {}    # confirmed blocks per replica
        # per replica: key -> expiry of its speculative blocks (None: not speculative), how many
        # there are, and the intervals speculated, oldest first (expiry never decreases along it)
        self._spec: dict[str, Intervals[float | None]] = {}
        self._spec_n: dict[str, int] = {}
        self._queue: dict[str, deque[tuple[float, int, int]]] = {}

    offloads = False   # no CPU tier here

    def prefix_classes(self, replica: str, keys: Sequence[int]) -> dict[str, int]:
        return {}   # untyped blocks only

    def bit(self, replica: str) -> int:
        b = self._bits.get(replica)
        if b is None:
            if not self._free and len(self._bits) >= self.width:
                raise ValueError(f"an index for {self.width} replicas cannot take {replica!r}")
            b = self._free.pop() if self._free else 1 << len(self._bits)
            self._bits[replica] = b
            self._names[b] = replica
            self._held[replica] = 0
        return b

    def blocks(self, replica: str) -> int:
        return self._held.get(replica, 0)

    def total_blocks(self) -> int:
        return sum(self._held.values())

    def speculative_blocks(self, replica: str, expire: bool = True) -> int:
        if expire:
            self.expire()
        return self._spec_n.get(replica, 0)

    # ---- the table -----------------------------------------------------------------------
    def _change(self, spans: Runs, fn: Callable[[int, int], int], arg: int,
                count: int) -> tuple[int, int]:
        """Every key of `spans` has its mask `fn(mask, arg)`; returns how many keys had bits of
        `count` set and how many had them clear, before."""
        table = self.table
        had = clear = 0
        for first, end in spans:
            i, j = table.span(first, end)
            masks = table.values[i:j]
            if count:
                for m, n in zip(masks, table.lengths(i, j, end)):
                    if m & count:
                        had += n
                    else:
                        clear += n
            table.put(i, j, list(map(fn, masks, repeat(arg))))
        return had, clear

    def _pending(self, replica: str) -> Intervals[float | None]:
        p = self._spec.get(replica)
        if p is None:
            p = self._spec[replica] = Intervals(None)
            self._spec_n[replica] = 0
            self._queue[replica] = deque()
        return p

    def _unspeculate(self, replica: str, spans: Runs, until: float | None = None) -> int:
        """Drop `replica`'s speculative blocks among `spans` (only those expiring by `until`, when
        given); returns how many."""
        pending = self._spec.get(replica)
        if pending is None or not self._spec_n[replica]:
            return 0
        gone: Runs = []
        for first, end in spans:
            i, j = pending.span(first, end)
            values = pending.values[i:j]
            for k, (a, b, v) in enumerate(zip(pending.starts[i:j], pending.starts[i + 1:j + 1], values)):
                if v is not None and (until is None or v <= until):
                    gone.append((a, b))
                    values[k] = None
            pending.put(i, j, values)
        n = sum(b - a for a, b in gone)
        if n:
            self._spec_n[replica] -= n
            self._change(gone, and_, ~(self._bits[replica] << self.width), 0)
        return n

    # ---- PreciseIndex's calls ---------------------------------------------------------------
    def speculate(self, replica: str, keys: Sequence[int]) -> int:
        """As `PreciseIndex.speculate`."""
        if self.speculative_ttl_s <= 0 or not keys:
            return 0
        now = self._clock()
        self.expire(now)
        if self.unread_from is not None:
            keys = keys[:bisect_left(keys, True, key=self.unread_from.__le__)]
        b = self.bit(replica)
        until = now + self.speculative_ttl_s
        table = self.table
        added: Runs = []   # the keys not confirmed on the replica
        for first, end in runs(keys):
            i, j = table.span(first, end)
            starts, masks = table.starts, table.values
            for k in range(i, j):
                if not masks[k] & b:
                    a, z = starts[k], starts[k + 1]
                    if added and added[-1][1] == a:
                        added[-1] = (added[-1][0], z)
                    else:
                        added.append((a, z))
        if not added:
            return 0
        pending = self._pending(replica)
        fresh = 0
        for first, end in added:
            i, j = pending.span(first, end)
            fresh += sum(n for v, n in zip(pending.values[i:j], pending.lengths(i, j, end)) if v is None)
            pending.put(i, j, [until] * (j - i))
            self._queue[replica].append((until, first, end))
        self._spec_n[replica] += fresh
        self._change(added, or_, b << self.width, 0)
        return sum(z - a for a, z in added)

    def expire(self, now: float | None = None) -> int:
        """As `PreciseIndex.expire`."""
        if not self._spec:
            return 0
        now = self._clock() if now is None else now
        n = 0
        for replica, queue in self._queue.items():
            while queue and queue[0][0] <= now:
                _, first, end = queue.popleft()
                n += self._unspeculate(replica, [(first, end)], now)
        self.expired += n
        return n

    def apply(self, replica: str, events: Iterable[Event], keep_speculative: bool = False) -> int:
        """As `PreciseIndex.apply` with `engine_keys`, for GPU blocks with no retention class."""
        b = self.bit(replica)
        touched = 0
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.medium == "CPU" or ev.retention_classes is not None:
                    raise ValueError("the interval index holds untyped GPU blocks only")
                bs = ev.block_size
                keys = cast(list[int], ev.block_hashes)   # the twin's engines: a block's hash is its key
                if bs <= 0:
                    self.unresolved += len(keys)
                    continue
                self.block_size[replica] = bs
                parent = ev.parent_block_hash
                if parent is not None and not self.table.at(cast(int, parent)) & b:
                    self.unresolved += len(keys)
                    continue
                touched += len(keys)
                if self.unread_from is not None:
                    read = bisect_left(keys, True, key=self.unread_from.__le__)
                    if not read:
                        continue
                    keys = keys[:read]
                # a trace prompt's keys (engine/sim/runpool.py stores them as they came): runs already
                spans = runs(keys if isinstance(keys, RunKeys) else sorted(keys))
                self.confirmed += self._unspeculate(replica, spans)
                had, new = self._change(spans, or_, b, b)
                self._held[replica] += new
            elif isinstance(ev, BlockRemoved):
                if ev.medium == "CPU":
                    raise ValueError("the interval index holds untyped GPU blocks only")
                keys = sorted(cast(list[int], ev.block_hashes))
                if self.unread_from is not None:   # never stored: no work
                    keys = keys[:bisect_left(keys, self.unread_from)]
                spans = runs(keys)
                had, _ = self._change(spans, and_, ~b, b)
                self._held[replica] -= had
                touched += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(replica, keep_speculative=keep_speculative)
        return touched

    def clear(self, replica: str, keep_speculative: bool = False) -> None:
        """As `PreciseIndex.clear`."""
        b = self._bits.get(replica)
        if b is None:
            return
        drop = b if keep_speculative else b | b << self.width
        if not keep_speculative and replica in self._spec:
            self._spec[replica] = Intervals(None)
            self._spec_n[replica] = 0
            self._queue[replica].clear()
        table = self.table
        table.put(1, len(table.starts), [m & ~drop for m in table.values[1:]])
        self._held[replica] = 0

    def remove(self, replica: str) -> None:
        """As `PreciseIndex.remove`."""
        self.clear(replica)
        b = self._bits.pop(replica, None)
        if b is not None:
            del self._names[b]
            self._free.append(b)
        self._spec.pop(replica, None)
        self._spec_n.pop(replica, None)
        self._queue.pop(replica, None)
        self._held.pop(replica, None)
        self.block_size.pop(replica, None)

    def match(self, keys_by_size: Mapping[int, Sequence[int]], sizes: Mapping[str, int],
              speculative: bool = True, offloaded: bool = False) -> dict[str, int]:
        """As `PreciseIndex.match`: a lookup's keys ascend."""
        if speculative:
            self.expire()
        out: dict[str, int] = {}
        groups: dict[int, int] = {}
        for r, bs in sizes.items():
            out[r] = 0
            b = self._bits.get(r)
            if b is not None:
                groups[bs] = groups.get(bs, 0) | b
        starts, masks, width, names = self.table.starts, self.table.values, self.width, self._names
        last = len(starts) - 1
        for bs, group in groups.items():
            keys = keys_by_size.get(bs)
            if not keys:
                continue
            alive, depth = group, 0
            for first, end in runs(keys):
                i = bisect_right(starts, first) - 1
                at = first
                while True:
                    m = masks[i]
                    held = alive & (m | m >> width if speculative else m)
                    if held != alive:
                        gone = alive ^ held
                        while gone:
                            low = gone & -gone
                            out[names[low]] = (depth + at - first) * bs
                            gone ^= low
                        alive = held
                        if not alive:
                            break
                    if i == last:
                        break
                    i += 1
                    at = starts[i]
                    if at >= end:
                        break
                if not alive:
                    break
                depth += end - first
            while alive:
                low = alive & -alive
                out[names[low]] = depth * bs
                alive ^= low
        return out
