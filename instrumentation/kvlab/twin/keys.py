"""A trace prompt's block keys from its structure, in place of hashing its tokens.

A trace prompt (feed.py) is the chat template's head, then the token windows its hash ids stand
for, cut to its length, then the template's tail. The trace's ids are chained: requests that
share a leading run of ids share that prefix. So a block's tokens, and every token before them,
are fixed by where the block ends:

- in the head: by its place alone (every prompt has the same head);
- in a trace block: by the send round, the chain of ids up to that block, and the block's place in it;
- in the tail: by the send round, the chain, the prompt's trace tokens, and the block's place.

Equal keys mean equal prefixes, as with hashing (tests/test_twin_keys.py compares the two key
sets), with one difference, where the keys follow the trace: the feed's windows come from one
pool of a million word ids, so the windows of two different ids sometimes coincide, and their
hashed tokens would then share blocks the trace says differ (100,000 requests of the synthetic
trace, 26 rounds of it: 3,239 prompts' first window equals another id's; none in 10,000 of the
conversation trace). Below `MIN_BLOCK` tokens a block is hashed all the same: the windows hold a
few hundred distinct words, so two windows of different ids would too often begin with the same
token or two. The blocks of an answer are keyed by structure too (`AnswerKeys`), where every
output token is one id and no chunk continues an answer; else the engines hash them.

Why: the keys are small integers, and a prompt's new blocks get consecutive ones. Python hashes a
small integer to itself, so every dict a block passes through (the pools' caches, the index's
tables) is read and written next to where it was last touched, not at a random place as with
64-bit hashes. With that, and the feed's words shared as one object each, the twin ran 1.5x
faster (docs/benchmarks.md).

Told how many prompts will be sent (`expect`), the keys also say which blocks no lookup will read:
a chain (in a send round) that one prompt alone passes through holds blocks no other prompt has,
and so does a tail that one prompt alone ends with; the router looks a prompt's blocks up once,
before it sends it anywhere. Those blocks get the keys from `unread` up, above every other
structural key and below the answers' blocks, which no prompt holds either. The
twin's index keeps no block from there up (kvcache/index.py `PreciseIndex.unread_from`): the
router's answers are the same, for less of the index's work (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.runkeys import Keys, RunKeys

if TYPE_CHECKING:
    from kvlab.engine.sim.scheduler import Request

MIN_BLOCK = 8   # tokens: the smallest block keyed by structure
HASHED = 1 << 62   # structural keys stay below (hashes are 64-bit: a few in a billion fall there)


class TraceKeys:
    """Block keys of one trace's prompts. `head` and `tail`: the template's tokens before and
    after the trace's; `trace_block`: tokens per trace block; `rows`: every row's hash ids and
    trace tokens, in the trace's order (a prompt is the rows in order, round after round)."""

    def __init__(self, head: int, tail: int, trace_block: int, rows: Sequence[tuple[Sequence[int], int]]) -> None:
        self.head, self.tail, self.trace_block = head, tail, trace_block
        self._tokens = [tokens for _, tokens in rows]
        low = min(min(ids) for ids, _ in rows)
        stride = max(max(ids) for ids, _ in rows) - low + 1
        nodes: dict[int, int] = {}   # (the chain before, the id) as one int -> the chain's number
        ends: dict[tuple[int, int], int] = {}   # (the last chain, trace tokens) -> the tail's number
        self._paths: list[list[int]] = []   # each row's chains, one a trace block it reaches into
        self._ends: list[int] = []
        for ids, tokens in rows:
            path, chain = [], 0
            for h in ids[:-(-tokens // trace_block)]:
                chain = nodes.setdefault(chain * stride + h - low, len(nodes)) + 1
                path.append(chain - 1)
            self._paths.append(path)
            self._ends.append(ends.setdefault((chain, tokens), len(ends)))
        self._chains, self._tails = len(nodes), len(ends)
        self._rounds = 0   # told: the rounds that will be sent (0: not told, nothing unread)
        self._alone: list[tuple[bytes, bytes]] = []

    def expect(self, sent: int | None) -> None:
        """At most `sent` prompts will be sent (None: unknown): the chains and tails a single one
        of them passes through or ends with, in the rounds before the last and in the last."""
        if sent is None:
            self._rounds, self._alone = 0, []
            return
        rows = len(self._paths)
        self._rounds = -(-sent // rows)
        flat = np.fromiter((n for path in self._paths for n in path), np.int64)
        upto = np.cumsum([len(path) for path in self._paths])
        ends = np.asarray(self._ends, np.int64)

        def alone(n: int) -> tuple[bytes, bytes]:   # over the first n rows: 1 where one passes
            return ((np.bincount(flat[:upto[n - 1]], minlength=self._chains) == 1).tobytes(),
                    (np.bincount(ends[:n], minlength=self._tails) == 1).tobytes())
        every = alone(rows)
        self._alone = [every, alone(sent - (self._rounds - 1) * rows) if sent % rows else every]

    def unread(self, block_size: int) -> int | None:
        """From which key up (at this block size) no block is read by a lookup: None unless told
        how many prompts will be sent, or when blocks this small are hashed."""
        if not self._rounds or block_size < MIN_BLOCK:
            return None
        line = self.head // block_size + 1 + self._rounds * self._round(block_size)
        return line if 2 * line < HASHED else None   # billions of rounds: keys that big would be hashes'

    def bound(self, block_size: int) -> int:
        """Every prompt's structural key (at this block size) stays below it: the answers' keys
        by structure start there (`AnswerKeys`), hashed ones are almost all above."""
        line = self.unread(block_size)
        return HASHED if line is None else line + self._rounds * self._round(block_size)

    def _round(self, block_size: int) -> int:
        """How many keys one round's trace blocks and tails can take."""
        return self._chains * ((self.trace_block - 1) // block_size + 1) + self._tails * (self.tail // block_size + 1)

    def keys(self, row: int, round_: int, tokens: Sequence[int], block_size: int) -> Keys:
        """The keys of every full block of `tokens`: the prompt of row `row` sent in round `round_`
        (as runs: kvcache/runkeys.py)."""
        head, size, bs = self.head, self.trace_block, block_size
        if bs < MIN_BLOCK:
            return block_keys(tokens, bs)
        in_head = head // bs
        keys = RunKeys([(1, in_head + 1)])
        places = (size - 1) // bs + 1          # block ends one trace block can hold, at most
        span = self._round(bs)
        first = in_head + 1 + round_ * span
        line = self.unread(bs)
        unread = (line or 0) + round_ * span   # the same place, unread
        chains, tails = self._alone[round_ == self._rounds - 1] if line is not None else (None, None)
        trace_tokens = self._tokens[row]
        for i, node in enumerate(self._paths[row]):
            start = i * size
            # the blocks whose last token is in this trace block (ends at multiples of bs)
            lo = -(-(head + start + 1) // bs)
            hi = (head + min(start + size, trace_tokens)) // bs
            if hi >= lo:
                base = (unread if chains is not None and chains[node] else first) + node * places - (head + start) // bs
                keys.add(base + lo - 1, base + hi)
        end = self._ends[row]
        at = (unread if tails is not None and tails[end] else first) + self._chains * places
        at += end * (self.tail // bs + 1)
        keys.add(at, at + len(tokens) // bs - len(keys))   # the blocks ending in the tail
        return keys


class AnswerKeys:
    """Keys of the answers' blocks by structure, where every output token is one id (the twin's
    engines with no MoE sampler, twin/gateway.py), in place of hashing them on from the prompt's.

    Hashed, an answer's blocks chain on from its prompt's last full block over the tokens after
    it, then the output's: two answers share keys exactly when their prompts agree up to the
    prompt's end (their last full blocks' keys and the tokens after those). So each such prompt
    end gets `stride` consecutive keys, from `first` up, one a block, and a request's answer blocks
    take them in order (engine/sim/scheduler.py `answer_keys`): as a prompt's keys, runs the pools
    keep as runs. `first` is above every prompt's key and `stride` above the blocks a request can
    hold, so no two chains meet; no lookup of the index reads them (they are above `unread`).
    """

    __slots__ = ("_bases", "_block_size", "_next", "_stride")

    def __init__(self, first: int, stride: int, block_size: int) -> None:
        self._next = first
        self._stride = stride
        self._block_size = block_size
        self._bases: dict[tuple[int, tuple[int, ...]], int] = {}

    def first(self, req: Request) -> int:
        """The key of the first block of `req`'s answer (its block after the prompt's full ones)."""
        bs = self._block_size
        n = req.num_prompt // bs
        end = (req.keys[n - 1] if n else -1, tuple(req.prompt[n * bs:req.num_prompt]))
        base = self._bases.get(end)
        if base is None:
            base = self._bases[end] = self._next
            self._next += self._stride
        return base
