"""A trace prompt's block keys from its structure, in place of hashing its tokens.

A trace prompt (feed.py) is the chat template's head, then the token windows its hash ids stand
for, cut to its length, then the template's tail. The trace's ids are chained: requests that
share a leading run of ids share that prefix. So a block's tokens, and every token before them,
are fixed by where the block ends:

- in the head: by its place alone (every prompt has the same head);
- in a trace block: by the send round, the chain of ids up to that block, and the block's place in it;
- in the tail: by the prompt's length too. From the first such block on, keys are the gateway's
  hash (`hashing.block_keys`), chained on from the last structural key.

Equal keys mean equal prefixes, as with hashing (tests/test_twin_keys.py compares the two key
sets), with one difference, where the keys follow the trace: the feed's windows come from one
pool of a million word ids, so the windows of two different ids sometimes coincide, and their
hashed tokens would then share blocks the trace says differ (100,000 requests of the synthetic
trace, 26 rounds of it: 3,239 prompts' first window equals another id's; none in 10,000 of the
conversation trace). Below `MIN_BLOCK` tokens a block is hashed all the same: the windows hold a
few hundred distinct words, so two windows of different ids would too often begin with the same
token or two.

Why: the keys are small integers, and a prompt's new blocks get consecutive ones. Python hashes a
small integer to itself, so every dict a block passes through (the pools' caches, the index's
tables) is read and written next to where it was last touched, not at a random place as with
64-bit hashes. With that, and the feed's words shared as one object each, the twin ran 1.5x
faster (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.kvcache.hashing import block_keys, continue_keys

MIN_BLOCK = 8   # tokens: the smallest block keyed by structure


class TraceKeys:
    """Block keys of one trace's prompts. `head`: the template's tokens before the trace's;
    `trace_block`: tokens per trace block; `ids`: every prompt's hash ids (for the key ranges)."""

    def __init__(self, head: int, trace_block: int, ids: Sequence[Sequence[int]]) -> None:
        self.head = head
        self.trace_block = trace_block
        self._low = min(min(row) for row in ids)
        self._stride = max(max(row) for row in ids) - self._low + 1
        self._chains = sum(len(row) for row in ids)   # no more distinct chains than ids
        self._nodes: dict[int, int] = {}   # (the chain before, the id) as one int -> the chain's number

    def keys(self, ids: Sequence[int], round_: int, trace_tokens: int, tokens: Sequence[int],
             block_size: int) -> list[int]:
        """The keys of every full block of `tokens`: a prompt of the ids `ids` sent in round `round_`,
        holding `trace_tokens` of the trace's tokens between the head and the tail."""
        head, size, bs = self.head, self.trace_block, block_size
        if bs < MIN_BLOCK:
            return block_keys(tokens, bs)
        in_head = head // bs
        keys = list(range(1, in_head + 1))
        first = in_head + 1
        places = (size - 1) // bs + 1          # block ends one trace block can hold, at most
        nodes, stride, low = self._nodes, self._stride, self._low
        chain = 0
        for i, h in enumerate(ids):
            start = i * size
            if start >= trace_tokens:
                break
            at = chain * stride + h - low
            node = nodes.get(at)
            if node is None:
                node = nodes[at] = len(nodes)
            chain = node + 1
            # the blocks whose last token is in this trace block (ends at multiples of bs)
            lo = -(-(head + start + 1) // bs)
            hi = (head + min(start + size, trace_tokens)) // bs
            if hi >= lo:
                base = first + (round_ * self._chains + node) * places - (head + start) // bs
                keys.extend(range(base + lo - 1, base + hi))
        return continue_keys(keys, tokens, bs)
