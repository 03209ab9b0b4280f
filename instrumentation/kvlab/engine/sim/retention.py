"""Typed KV-cache retention (experimental): retention classes, the directives that set them, and
the eviction order that honours them.

A request may carry *retention directives*, token ranges with a priority 0-100, shaped after
vLLM's proposal (RFC vllm-project/vllm#37003, PR #38514: `retention_directives` =
`[{"start", "end", "priority", "duration"}]` plus `retention_scope`), in its body or in the
`x-kvlab-retention` header (the same JSON list). Nothing of it ships in vLLM yet: the field
names may change. The simulator folds priorities into four classes:

    priority >= 90  pinned       kept while free, up to `pinned_share` of the cache
    priority >= 60  high         evicted after normal blocks
    priority >= 30  normal       LRU (tokens no directive covers)
    priority <  30  evict-first  evicted before anything else

A block takes the lowest class of the tokens it holds (a block straddling a system prompt and a
user turn is not pinned). `duration` is accepted and recorded but not enforced by the simulator.
The free queue (`ClassedFreeQueue`) keeps one LRU queue per class and evicts from the lowest
class first; pinned blocks go only when nothing else is free, so pinning never wedges the cache.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec

from kvlab.errors import RequestError

if TYPE_CHECKING:
    from kvlab.engine.sim.blockpool import Block

EVICT_FIRST, NORMAL, HIGH, PINNED = 0, 1, 2, 3
CLASS_NAMES = ("evict-first", "normal", "high", "pinned")
PARAM = "retention_directives"


class RetentionDirective(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One token range `[start, end)` (end None: to the end, generated tokens included)."""

    start: int
    end: int | None = None
    priority: int
    duration: float | None = None


_decoder = msgspec.json.Decoder(list[RetentionDirective])


def class_of(priority: int) -> int:
    if priority >= 90:
        return PINNED
    if priority >= 60:
        return HIGH
    if priority >= 30:
        return NORMAL
    return EVICT_FIRST


def parse(raw: Any, source: str = PARAM) -> list[RetentionDirective]:
    """Directives from a body field (parsed JSON) or a header (a JSON string); a RequestError (400)
    naming what is wrong otherwise."""
    try:
        directives = (_decoder.decode(raw) if isinstance(raw, str)
                      else msgspec.convert(raw, list[RetentionDirective]))
    except (msgspec.ValidationError, msgspec.DecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"invalid {source}: {exc}", param=PARAM) from None
    prev_end = 0
    for i, d in enumerate(sorted(directives, key=lambda d: d.start)):
        where = f"{source}[{i}]"
        if d.start < 0:
            raise RequestError(f"{where}: start must be >= 0", param=PARAM)
        if d.end is not None and d.end <= d.start:
            raise RequestError(f"{where}: end must be greater than start", param=PARAM)
        if not 0 <= d.priority <= 100:
            raise RequestError(f"{where}: priority must be between 0 and 100", param=PARAM)
        if d.duration is not None and d.duration <= 0:
            raise RequestError(f"{where}: duration must be positive (seconds)", param=PARAM)
        if i and d.start < prev_end:
            raise RequestError(f"{where}: token ranges must not overlap", param=PARAM)
        prev_end = d.end if d.end is not None else 1 << 62
    return directives


def block_classes(directives: list[RetentionDirective], n_blocks: int, block_size: int) -> list[int]:
    """The class of each of the first `n_blocks` blocks: the lowest class of its tokens."""
    out = []
    for b in range(n_blocks):
        lo, hi = b * block_size, (b + 1) * block_size
        cls, covered = PINNED, 0
        for d in directives:
            end = hi if d.end is None else min(d.end, hi)
            start = max(d.start, lo)
            if end > start:
                cls = min(cls, class_of(d.priority))
                covered += end - start
        out.append(cls if covered == block_size else min(cls, NORMAL))
    return out


class RetentionStats:
    """Counters per class: cached-block lookups and hits, evictions, pins refused by the bound."""

    def __init__(self) -> None:
        self.queries = [0, 0, 0, 0]
        self.hits = [0, 0, 0, 0]
        self.evictions = [0, 0, 0, 0]
        self.pins_refused = 0


class ClassedFreeQueue:
    """The block pool's free queue with one LRU queue per class (the interface of freequeue.py's
    `FreeQueue`). Pinned blocks, free or held, are bounded by `max_pinned`; beyond it a block asked
    to be pinned is kept as high."""

    def __init__(self, blocks: list[Block], pinned_share: float) -> None:
        if not 0.0 <= pinned_share < 1.0:
            raise ValueError("pinned_share must be in [0, 1)")
        self.max_pinned = int(pinned_share * len(blocks))
        self.pinned = 0
        self.stats = RetentionStats()
        self._queues: list[OrderedDict[int, Block]] = [OrderedDict() for _ in CLASS_NAMES]
        self._queues[NORMAL].update((b.id, b) for b in blocks)
        self._where: dict[int, int] = {b.id: NORMAL for b in blocks}

    def __len__(self) -> int:
        return len(self._where)

    def _put(self, block: Block) -> None:
        self._queues[block.cls][block.id] = block
        self._where[block.id] = block.cls

    def remove(self, block: Block) -> None:
        """A free cached block taken back by a request."""
        del self._queues[self._where.pop(block.id)][block.id]

    def push(self, blocks: list[Block]) -> None:
        """Blocks just freed, in order: cached ones to the back of their class's queue, each
        uncached one to its front."""
        for block in blocks:
            self._put(block)
            if block.key is None:
                self._queues[block.cls].move_to_end(block.id, last=False)

    def pop(self, n: int) -> list[Block]:
        """The `n` next victims, each the LRU block of the lowest class that has one."""
        return [self._pop() for _ in range(n)]

    def _pop(self) -> Block:
        for cls, queue in enumerate(self._queues):
            if queue:
                block_id, block = queue.popitem(last=False)
                del self._where[block_id]
                if block.key is not None:
                    self.stats.evictions[cls] += 1
                self.set_class(block, NORMAL)
                return block
        raise IndexError("pop from a free queue with too few blocks")

    def set_class(self, block: Block, cls: int) -> None:
        """Give a block a class (pinned only within the bound); re-queues it if it is free."""
        if cls == PINNED and block.cls != PINNED and self.pinned >= self.max_pinned:
            cls = HIGH
            self.stats.pins_refused += 1
        if cls == block.cls:
            return
        self.pinned += (cls == PINNED) - (block.cls == PINNED)
        where = self._where.get(block.id)
        if where is not None:
            del self._queues[where][block.id]
        block.cls = cls
        if where is not None:
            self._put(block)

    def counts(self) -> list[int]:
        """Free blocks per class."""
        return [len(q) for q in self._queues]
