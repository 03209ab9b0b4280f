"""The oracle hit rate: a ceiling on the prefix-cache hit rate any router can reach on a workload.

Given the prompts of a workload in arrival order (token blocks, keyed by the chained hash) and the
replicas' capacity (blocks per replica x replicas), the ceiling is the block hit rate of **one
pooled cache of the total capacity run with Belady's optimal offline replacement** (evict the
block whose next use is farthest in the future; a block needed later than everything cached is
not kept at all). Why this is an upper bound for every router on those replicas:

- pooled >= partitioned: whatever the replicas hold at any moment, their union is at most the
  total capacity, and a block a request reuses on its replica is in that union; so the union is
  itself a pooled cache policy that hits at least as often as any routing;
- Belady maximises hits among all replacement policies of a cache of that size (Belady 1966;
  Mattson et al. 1970), so it hits at least as often as that union;
- it counts every cached block of a prompt, not only the leading run an engine can reuse, and it
  does not apply the engine's last-token rule (a fully cached prompt reuses one block less), so
  it can only overstate what an engine could report.

LRU on the pooled cache would *not* be a bound: two partitioned LRU caches can beat one pooled
LRU cache on some sequences. With `capacity_blocks=None` the cache is unbounded: the ceiling is
then every block seen before (the workload's reuse alone).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvlab.gateway.tokens import PromptTokenizer
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.runkeys import RunKeys
from kvlab.load.measure import Record
from kvlab.load.workloads import Workload, WorkloadRequest

_CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: int             # prompt length in tokens (the hit rate's denominator)
    keys: Sequence[int]     # its full blocks' chained keys


@dataclass(frozen=True, slots=True)
class Oracle:
    prompt_tokens: int
    hit_tokens: int
    block_size: int
    capacity_blocks: int | None    # None: unbounded

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prompts(requests: Iterable[WorkloadRequest], block_size: int,
            tokenizer: PromptTokenizer | None = None) -> list[Prompt]:
    """Each request's prompt as the gateway tokenizes it (the model's chat template), in blocks."""
    tok = tokenizer or PromptTokenizer()
    out = []
    for r in requests:
        ids, _ = tok.encode_chat(r.messages)
        out.append(Prompt(len(ids), block_keys(ids, block_size)))
    return out


def ceiling(reqs: Sequence[Prompt], block_size: int, capacity_blocks: int | None) -> Oracle:
    """Belady's block hits on one pooled cache of `capacity_blocks` (None: unbounded)."""
    prompt_tokens = sum(p.tokens for p in reqs)
    seq = _sequence(reqs)
    n = len(seq)
    if capacity_blocks is None:   # every block seen before is a hit
        return Oracle(prompt_tokens, (n - len(np.unique(seq))) * block_size, block_size, None)
    return Oracle(prompt_tokens, _belady(_next_uses(seq), capacity_blocks) * block_size, block_size, capacity_blocks)


def _sequence(reqs: Sequence[Prompt]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """Every prompt's keys in order, as one array. A twin trace prompt's are runs (`RunKeys`):
    the keys of all of them at once, each run's first key less its place spread over its keys and
    added to the places (modulo 2**64, as unsigned integers wrap); else each prompt's keys, read
    through the buffer protocol where they are an array('Q')."""
    if not reqs:
        return np.zeros(0, np.uint64)
    if all(isinstance(p.keys, RunKeys) for p in reqs):
        runs = np.array([run for p in reqs for run in cast(RunKeys, p.keys).runs], dtype=np.uint64).reshape(-1, 2)
        lengths = runs[:, 1] - runs[:, 0]
        places = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        seq: np.ndarray[Any, np.dtype[np.uint64]] = np.arange(total, dtype=np.uint64)
        seq += np.repeat(runs[:, 0] - places, lengths.astype(np.int64))
        return seq
    return np.concatenate([np.asarray(p.keys, dtype=np.uint64) for p in reqs])


def _next_uses(seq: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Each position's next use of its key (`len(seq)`: never), from the positions sorted by key."""
    n = len(seq)
    order = np.argsort(seq, kind="stable")   # stable: one key's positions in order
    ordered = seq[order]
    same = ordered[1:] == ordered[:-1]
    nxt = np.full(n, n, dtype=np.int64)
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def _belady(nxt: np.ndarray[Any, np.dtype[np.int64]], capacity: int) -> int:
    """Hits of Belady with bypass, the cache held as the next uses of its blocks (a max-heap of
    positions): a block never used again takes no room (it could only ever be evicted first), so
    only blocks with a next use are kept, and a position is a hit when its block was kept for it."""
    n = len(nxt)
    if capacity <= 0:
        return 0
    # the blocks waiting for their next use after each position; while they fit, Belady keeps them
    # all and every reuse is a hit (usually so at a fleet's full size): no heap needed
    reused = np.flatnonzero(nxt < n)
    waiting = np.bincount(reused, minlength=n)
    waiting -= np.bincount(nxt[reused], minlength=n)
    if len(reused) == 0 or int(np.cumsum(waiting, out=waiting).max()) <= capacity:
        return len(reused)
    del waiting
    kept = bytearray(n)     # position -> its block is cached for this use
    heap: list[int] = []    # -(next use) per cached block; entries of past uses sink below the live ones
    size = hits = 0
    push, replace = heapq.heappush, heapq.heapreplace
    for lo in range(0, n, _CHUNK):   # the next uses as Python ints a chunk at a time (memory)
        for i, j in enumerate(nxt[lo:lo + _CHUNK].tolist(), lo):
            if kept[i]:
                hits += 1
                if j < n:
                    kept[j] = 1
                    push(heap, -j)
                else:
                    size -= 1
            elif j < n:
                if size < capacity:
                    kept[j] = 1
                    push(heap, -j)
                    size += 1
                elif -heap[0] > j:   # the block needed farthest ahead makes room (else this one is not kept)
                    kept[-replace(heap, -j)] = 0
                    kept[j] = 1
        if len(heap) > 2 * size + _CHUNK:   # drop the entries of past uses
            heap = [x for x in heap if -x >= lo + _CHUNK]
            heapq.heapify(heap)
    return hits


def oracle(requests: Iterable[WorkloadRequest], block_size: int, replicas: int, blocks_per_replica: int | None,
           tokenizer: PromptTokenizer | None = None) -> Oracle:
    """The ceiling for `requests` on `replicas` replicas of `blocks_per_replica` blocks each."""
    cap = None if blocks_per_replica is None else replicas * blocks_per_replica
    return ceiling(prompts(requests, block_size, tokenizer), block_size, cap)


def replayed(workload: Workload[Any], records: Sequence[Record]) -> list[WorkloadRequest]:
    """The requests a load run sent, in the order they were sent, rebuilt from the workload's seeded
    stream and the `session`/`step` each record carries (the successful ones: the hit rate's base)."""
    done = sorted(((r.ts, r.session, r.step) for r in records if not r.error and r.session is not None),
                  key=lambda sent: sent[0])
    if not done:
        return []
    needed = max(session for _, session, _ in done) + 1
    sessions = list(itertools.islice(workload.sessions(), needed))
    return [sessions[session][step] for _, session, step in done]
