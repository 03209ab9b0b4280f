"""The gateway's block index: which replica holds which prompt blocks.

One `BlockTable` maps a block key (the gateway's chained hash, `hashing.block_keys`) to a bit
mask of the replicas holding it, so a prefix lookup for every replica at once is one dict lookup
per block: walk the request's keys, AND the masks, note the depth at which each replica drops out.

- `PreciseIndex` is fed by the replicas' KV events. Keys are recomputed from
  `BlockStored.token_ids` (parent chained through a map from the engine's hash to our key), so the
  index never depends on the engine's hash function or seed; that same map serves `BlockRemoved`.
  Its *speculative* layer closes the window between a routing decision and the engine's
  `BlockStored`: the chosen replica's blocks are added provisionally with a TTL, confirmed by
  `BlockStored`, dropped by `BlockRemoved`, `AllBlocksCleared`, the replica leaving, or expiry. A
  lookup says how much of each matched prefix was confirmed and how much speculative.
- `ApproximateIndex` learns from the gateway's own routing decisions (the blocks of a prompt are
  assumed cached where it was sent), with a bounded LRU per replica, for replicas without events.

Replicas may use different block sizes: keys depend on the block size, so a lookup takes the
request's keys per block size (`keys_by_size`) and each replica is matched against its own.

Tiers: events with `medium: "CPU"` (vLLM's offloading connector, docs/tiered.md) go to a separate
*offloaded* layer of the same table, with their own engine-hash map per replica (one block may be on
GPU and in CPU at once); `match_tiers` tells how much of each prefix is on GPU and how much more is
reachable through the CPU tier.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import accumulate, compress, repeat, takewhile
from operator import and_, is_not, neg, not_, or_
from typing import cast

from kvlab.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvlab.kvcache.hashing import ROOT, block_keys

_present = partial(is_not, None)   # a popped key that was there


class BlockTable:
    """key -> bit mask of replicas; replicas are registered to get a bit."""

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.speculative: dict[int, int] = {}   # key -> replicas holding it only provisionally
        self.offloaded: dict[int, int] = {}     # key -> replicas holding it in their CPU tier
        self._bits: dict[str, int] = {}
        self._free: list[int] = []

    def bit(self, replica: str) -> int:
        """The replica's bit, allocated on first use."""
        b = self._bits.get(replica)
        if b is None:
            b = self._free.pop() if self._free else 1 << len(self._bits)
            self._bits[replica] = b
        return b

    def replicas(self) -> list[str]:
        return list(self._bits)

    def _layer(self, speculative: bool, offloaded: bool) -> dict[int, int]:
        return self.offloaded if offloaded else self.speculative if speculative else self.masks

    def add(self, replica: str, keys: Iterable[int], speculative: bool = False, offloaded: bool = False) -> None:
        b = self.bit(replica)
        masks = self._layer(speculative, offloaded)
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        # one pass in C (a prompt is hundreds of blocks): each key's mask or-ed with the bit
        masks.update(zip(keys, map(or_, map(masks.get, keys, repeat(0)), repeat(b))))

    def discard(self, replica: str, keys: Iterable[int], speculative: bool = False,
                offloaded: bool = False) -> None:
        """Clear the replica's bit on `keys` in the confirmed layer (or the speculative or offloaded one)."""
        b = self._bits.get(replica)
        if b is None:
            return
        masks = self._layer(speculative, offloaded)
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        # in C: every key popped with its mask (an absent key reads 0); the keys held elsewhere too
        # (the fewer) are put back without the bit: one lookup a key, not two
        left = list(map(and_, map(masks.pop, keys, repeat(0)), repeat(~b)))
        if any(left):
            masks.update(zip(compress(keys, left), filter(None, left)))

    def forget(self, replica: str, keys: Iterable[int]) -> None:
        """Drop all of a replica's keys and release its bit."""
        self.discard(replica, keys)
        b = self._bits.pop(replica, None)
        if b is not None:
            self._free.append(b)

    def match(self, keys_by_size: Mapping[int, Sequence[int]], sizes: Mapping[str, int],
              speculative: bool = False, offloaded: bool = False) -> dict[str, int]:
        """Cached prefix length in *tokens* of each replica of `sizes` (replica -> its block size);
        with `speculative`, a provisional block counts as held; with `offloaded`, a CPU-tier one."""
        out: dict[str, int] = {}
        groups: dict[int, int] = {}
        for r, bs in sizes.items():
            out[r] = 0
            b = self._bits.get(r)
            if b is not None:
                groups[bs] = groups.get(bs, 0) | b
        if not groups:
            return out
        by_bit = {b: r for r, b in self._bits.items()}
        masks = self.masks
        spec = self.speculative if speculative else {}
        cpu = self.offloaded if offloaded else {}
        for bs, group in groups.items():
            keys = keys_by_size.get(bs)
            if not keys:
                continue
            held: Iterator[int] = map(masks.get, keys, repeat(0))
            if spec:
                held = map(or_, held, map(spec.get, keys, repeat(0)))
            if cpu:
                held = map(or_, held, map(cpu.get, keys, repeat(0)))
            # the replicas still matching after each key, in C (the group itself first). As sets
            # they only shrink, so as numbers they never grow: each set's run ends where a binary
            # search finds the first smaller one, and the replicas gone then matched the keys before
            alive = list(takewhile(bool, accumulate(held, and_, initial=group)))
            n, i = len(alive), 0
            while i < n:
                now = alive[i]
                i = bisect_right(alive, -now, i + 1, n, key=neg)   # the first set smaller than `now`
                gone = now & ~alive[i] if i < n else now
                while gone:
                    low = gone & -gone
                    out[by_bit[low]] = (i - 1) * bs
                    gone ^= low
        return out


class PreciseIndex:
    """Fed by KV events. Per replica: engine hash -> gateway key (for removals and parents), and the
    speculative blocks not yet confirmed (key -> expiry, oldest first, so expiry pops from the front)."""

    def __init__(self, speculative_ttl_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 engine_keys: bool = False) -> None:
        self.table = BlockTable()
        # the engines hash blocks with our own family (`block_keys`, seed 0), so a BlockStored's
        # hashes are our keys and its token ids need no re-keying: the twin's engines, never a live one
        self.engine_keys = engine_keys
        # with engine keys: from which key up no lookup will read a block (the twin's trace says so,
        # twin/keys.py); such blocks are neither stored nor speculated: the answers stay, the work goes.
        # In a request's keys they come after all the others (so do its answer's, hashed above them): a
        # binary search finds where they begin, and a block stored after one of them is one too
        self.unread_from: int | None = None
        self._engine: dict[str, dict[object, int]] = {}
        self._offloaded: dict[str, dict[object, int]] = {}   # the same, for blocks in the CPU tier
        self.block_size: dict[str, int] = {}   # as announced by BlockStored events
        self.unresolved = 0   # stored blocks whose parent we never saw (skipped)
        self.speculative_ttl_s = speculative_ttl_s   # 0: no speculative layer
        self._clock = clock
        self._spec: dict[str, OrderedDict[int, float]] = {}
        self.confirmed = 0    # speculative blocks later confirmed by BlockStored
        self.expired = 0      # speculative blocks that expired unconfirmed
        # typed retention (experimental, docs/semantic-kv.md): replica -> key -> retention class, from
        # BlockStored.retention_classes; blocks stored without one are absent (untyped)
        self.classes: dict[str, dict[int, str]] = {}

    def blocks(self, replica: str) -> int:
        return len(self._engine.get(replica, ()))

    @property
    def offloads(self) -> bool:
        """Whether some replica reported blocks in its CPU tier."""
        return bool(self.table.offloaded)

    def cpu_blocks(self, replica: str) -> int:
        return len(self._offloaded.get(replica, ()))

    def speculative_blocks(self, replica: str, expire: bool = True) -> int:
        """Blocks `replica` holds only provisionally; `expire=False`: as of the last expiry (a
        lookup just made one)."""
        if expire:
            self.expire()
        return len(self._spec.get(replica, ()))

    def total_blocks(self) -> int:
        return sum(len(m) for m in self._engine.values())

    def speculate(self, replica: str, keys: Sequence[int]) -> int:
        """A request with these block keys was just routed to `replica`: hold its blocks there
        provisionally until the engine confirms them (or `speculative_ttl_s` passes). Blocks the
        replica already holds for sure are left alone. Returns the blocks added or refreshed."""
        if self.speculative_ttl_s <= 0 or not keys:
            return 0
        now = self._clock()
        self.expire(now)
        if self.unread_from is not None:
            keys = keys[:bisect_left(keys, True, key=self.unread_from.__le__)]
        b = self.table.bit(replica)
        confirmed = self.table.masks
        pending = self._spec.setdefault(replica, OrderedDict())
        until = now + self.speculative_ttl_s
        added = list(compress(keys, map(not_, map(and_, map(confirmed.get, keys, repeat(0)), repeat(b)))))
        held = len(pending)
        pending.update(zip(added, repeat(until)))   # new ones at the end, in order; then the others moved there
        if len(pending) - held < len(added):
            deque(map(pending.move_to_end, added), maxlen=0)
        self.table.add(replica, added, speculative=True)
        return len(added)

    def expire(self, now: float | None = None) -> int:
        """Reclaim speculative blocks past their TTL (called by every speculate and lookup)."""
        if not self._spec:
            return 0
        now = self._clock() if now is None else now
        n = 0
        for replica, pending in self._spec.items():
            gone = []
            while pending:
                k, until = next(iter(pending.items()))
                if until > now:
                    break
                pending.popitem(last=False)
                gone.append(k)
            if gone:
                self.table.discard(replica, gone, speculative=True)
                n += len(gone)
        self.expired += n
        return n

    def _drop_speculative(self, replica: str, keys: Iterable[int] | None = None) -> int:
        """Forget `replica`'s speculative blocks among `keys` (all of them when None)."""
        pending = self._spec.get(replica)
        if not pending:
            return 0
        if keys is None:
            gone = list(pending)
            pending.clear()
        else:
            keys = keys if isinstance(keys, (list, tuple)) else list(keys)
            gone = list(compress(keys, map(_present, map(pending.pop, keys, repeat(None)))))
        self.table.discard(replica, gone, speculative=True)
        return len(gone)

    def apply(self, replica: str, events: Iterable[Event], keep_speculative: bool = False) -> int:
        """Apply a batch of events from `replica`; returns the number of blocks touched.
        `keep_speculative`: an AllBlocksCleared leaves the speculative layer alone (a batch older
        than the routing that made it: a new subscriber's catch-up, gateway/kvevents.py)."""
        gmap = self._engine.get(replica)
        if gmap is None:
            gmap = self._engine[replica] = {}
            self.table.bit(replica)
        cmap = self._offloaded.setdefault(replica, {})
        table = self.table
        touched = 0
        for ev in events:
            if isinstance(ev, BlockStored):
                cpu = ev.medium == "CPU"
                emap = cmap if cpu else gmap
                bs = ev.block_size
                if bs <= 0:   # vLLM's placeholder payload (no token ids): nothing to key it by
                    self.unresolved += len(ev.block_hashes)
                    continue
                self.block_size[replica] = bs
                if ev.parent_block_hash is None:
                    parent = ROOT
                else:   # the parent may sit in either tier
                    found = gmap.get(ev.parent_block_hash)
                    if found is None:
                        found = cmap.get(ev.parent_block_hash)
                    if found is None:
                        self.unresolved += len(ev.block_hashes)
                        continue
                    parent = found
                keys = cast(list[int], ev.block_hashes) if self.engine_keys else block_keys(ev.token_ids, bs, parent)
                n = min(len(keys), len(ev.block_hashes))
                touched += n
                hashes: Sequence[object] = ev.block_hashes[:n]
                keys, classes = keys[:n], ev.retention_classes
                if self.unread_from is not None:   # engine keys: a block's hash is its key
                    read = bisect_left(keys, True, key=self.unread_from.__le__)
                    if read < n:
                        if not read:
                            continue
                        hashes = keys = keys[:read]
                        classes = None if classes is None else classes[:read]
                emap.update(zip(hashes, keys))
                table.add(replica, keys, offloaded=cpu)
                if not cpu:
                    if classes is not None:
                        self.classes.setdefault(replica, {}).update(zip(keys, classes))
                    self.confirmed += self._drop_speculative(replica, keys)
            elif isinstance(ev, BlockRemoved):
                # a removed block was stored first, which already ended its speculation
                cpu = ev.medium == "CPU"
                emap = cmap if cpu else gmap
                gone = [k for k in map(emap.pop, ev.block_hashes, repeat(None)) if k is not None]
                table.discard(replica, gone, offloaded=cpu)
                typed = None if cpu else self.classes.get(replica)
                if typed:
                    for k in gone:
                        typed.pop(k, None)
                touched += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(replica, keep_speculative=keep_speculative)
        return touched

    def clear(self, replica: str, keep_speculative: bool = False) -> None:
        """Forget everything `replica` held (reset, restart, or a gap made it untrustworthy); its
        speculative blocks too unless `keep_speculative`."""
        if not keep_speculative:
            self._drop_speculative(replica)
        self.classes.pop(replica, None)
        emap = self._engine.get(replica)
        if emap:
            self.table.discard(replica, emap.values())
            emap.clear()
        cmap = self._offloaded.get(replica)
        if cmap:
            self.table.discard(replica, cmap.values(), offloaded=True)
            cmap.clear()

    def remove(self, replica: str) -> None:
        """The replica left the endpoint set."""
        self._drop_speculative(replica)
        self._spec.pop(replica, None)
        self.classes.pop(replica, None)
        emap = self._engine.pop(replica, {})
        self.table.discard(replica, self._offloaded.pop(replica, {}).values(), offloaded=True)
        self.table.forget(replica, emap.values())
        self.block_size.pop(replica, None)

    def prefix_classes(self, replica: str, keys: Sequence[int]) -> dict[str, int]:
        """Blocks per retention class of the prefix of `keys` that `replica` holds (typed replicas)."""
        typed = self.classes.get(replica)
        out: dict[str, int] = {}
        if not typed:
            return out
        for k in keys:
            cls = typed.get(k)
            if cls is None:
                break
            out[cls] = out.get(cls, 0) + 1
        return out

    def match(self, keys_by_size: Mapping[int, Sequence[int]], sizes: Mapping[str, int],
              speculative: bool = True, offloaded: bool = False) -> dict[str, int]:
        """Prefix tokens per replica, speculative blocks included unless `speculative` is False,
        CPU-tier blocks too with `offloaded`."""
        if speculative:
            self.expire()
        return self.table.match(keys_by_size, sizes, speculative and bool(self._spec),
                                offloaded and bool(self.table.offloaded))

    def match_tiers(self, keys_by_size: Mapping[int, Sequence[int]], sizes: Mapping[str, int],
                    speculative: bool = True) -> tuple[dict[str, int], dict[str, int]]:
        """(prefix tokens on GPU, prefix tokens on GPU or in the CPU tier) per replica: the second
        is never shorter; the difference is what a replica would load instead of recompute."""
        gpu = self.match(keys_by_size, sizes, speculative)
        if not self.table.offloaded:
            return gpu, dict(gpu)
        both = self.table.match(keys_by_size, sizes, speculative and bool(self._spec), offloaded=True)
        return gpu, {r: max(both[r], gpu[r]) for r in gpu}


class ApproximateIndex:
    """Learned from routing decisions: a request's blocks are assumed cached where it went.
    Bounded per replica (LRU), like the replica's own cache."""

    def __init__(self, capacity_blocks: int = 100_000) -> None:
        self.table = BlockTable()
        self.capacity = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._block_size: dict[str, int] = {}
        self.capacity_of: dict[str, int] = {}

    def blocks(self, replica: str) -> int:
        return len(self._lru.get(replica, ()))

    def learn(self, replica: str, keys: Sequence[int], block_size: int) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            lru = self._lru[replica] = OrderedDict()
        if self._block_size.get(replica) != block_size:
            if lru:  # the replica's block size changed: old keys can never match again
                self.clear(replica)
            self._block_size[replica] = block_size
        lru.update(zip(keys, repeat(None)))   # new keys at the end, in order; then every key moved there
        deque(map(lru.move_to_end, keys), maxlen=0)
        self.table.add(replica, keys)
        cap = self.capacity_of.get(replica, self.capacity)
        if len(lru) > cap:
            evicted = [lru.popitem(last=False)[0] for _ in range(len(lru) - cap)]
            self.table.discard(replica, evicted)

    def clear(self, replica: str) -> None:
        lru = self._lru.get(replica)
        if lru:
            self.table.discard(replica, lru.keys())
            lru.clear()

    def remove(self, replica: str) -> None:
        lru = self._lru.pop(replica, OrderedDict())
        self.table.forget(replica, lru.keys())
        self.capacity_of.pop(replica, None)
        self._block_size.pop(replica, None)

    def match(self, keys_by_size: Mapping[int, Sequence[int]], sizes: Mapping[str, int]) -> dict[str, int]:
        return self.table.match(keys_by_size, sizes)
