"""The workload as the twin sends it: each request's prompt token ids, as the gateway tokenizes them.

A shipped workload's chat messages go through the gateway's own `PromptTokenizer` (the same ids
the live gateway routes on and the simulator computes). A Mooncake trace is different in size
(10,000 requests of ~12,000 tokens, too many to make and tokenize as text): its prompts are
assembled from per-block token ids inside the chat template's head and tail, each block a window
(at an offset given by its hash id) of a seeded pool of the single-token words' ids the trace
workload builds its text from. Token counts and the prefix structure are the trace's; the ids are not those of the live
run's text (they need not be: only which prompts share which blocks matters to a cache), and
their block keys come from that structure instead of from hashing the ids (keys.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from kvlab.gateway.tokens import PromptTokenizer
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.runkeys import Keys
from kvlab.load.workloads import Workload
from kvlab.load.workloads.trace import Trace, TraceRow, _single_token_words
from kvlab.twin.keys import HASHED, MIN_BLOCK, TraceKeys

_MARK = "\x00twin\x00"
_POOL = 1 << 20   # random word ids trace blocks are windows of


@dataclass(slots=True)
class Prompt:
    """One request to send: its token ids and what the records say about it."""

    tokens: Sequence[int]
    max_tokens: int
    group: str
    session: int
    step: int
    pause_s: float = 0.0
    row: TraceRow | None = None   # a trace prompt: its row, and the round of the trace it is sent in
    round_: int = 0


class Feed:
    """Sessions of prompts in the workload's stream order (deterministic for its seed)."""

    def __init__(self, workload: Workload[Any], tokenizer: PromptTokenizer | None = None) -> None:
        self.workload = workload
        self.tok = tokenizer or PromptTokenizer()
        self._pool: list[int] = []
        head, _, tail = self.tok.tok.render_chat([{"role": "user", "content": _MARK}]).partition(_MARK)
        self._head = self.tok.encode_text(head, False)[0]
        self._tail = self.tok.encode_text(tail, False)[0]
        self._keys: TraceKeys | None = None
        self._sent: int | None = None

    def sessions(self, sent: int | None = None) -> Iterator[list[Prompt]]:
        """The endless stream of sessions, each a list of prompts sent in order; `sent`: at most how
        many prompts will be taken from it (a trace's keys then say which blocks `unread` are)."""
        self._sent = sent
        if isinstance(self.workload, Trace):
            trace = self.workload
            if self._keys is None:
                self._keys = TraceKeys(len(self._head), len(self._tail), trace.block_tokens,
                                       [(row.hash_ids, trace_prompt_tokens(trace, row)) for row in trace.rows])
            self._keys.expect(sent)
            return self._trace(trace)
        return self._chats()

    def _chats(self) -> Iterator[list[Prompt]]:
        for n, session in enumerate(self.workload.sessions()):
            yield [Prompt(self.tok.encode_chat(r.messages)[0], r.max_tokens, r.group, n, i, r.pause_s)
                   for i, r in enumerate(session)]

    def block_keys(self, prompt: Prompt, block_size: int) -> Keys:
        """The keys of the prompt's full blocks: a trace prompt's from its structure (keys.py), any
        other's hashed as the gateway hashes them."""
        if prompt.row is None or self._keys is None:
            return block_keys(prompt.tokens, block_size)
        assert isinstance(self.workload, Trace)   # only a trace's prompts have a row
        if self._sent is not None and prompt.session >= self._sent:
            raise ValueError(f"prompt {prompt.session:,} of a stream begun for {self._sent:,}: "
                             "its keys could be unread")
        return self._keys.keys(prompt.session - prompt.round_ * len(self.workload.rows), prompt.round_,
                               prompt.tokens, block_size)

    def keys_ascend(self, block_size: int) -> bool:
        """Whether every prompt's keys ascend (a trace's, keyed by its structure: keys.py)."""
        return isinstance(self.workload, Trace) and block_size >= MIN_BLOCK

    def key_bound(self, block_size: int) -> int:
        """Where the keys ascend, a key every prompt's keys stay below (keys.py)."""
        return self._keys.bound(block_size) if self._keys is not None else HASHED

    def unread(self, block_size: int) -> int | None:
        """From which key up no lookup reads a block (keys.py); None unless the stream is a trace's,
        begun with `sent`."""
        return self._keys.unread(block_size) if self._keys is not None else None

    def _trace(self, trace: Trace) -> Iterator[list[Prompt]]:
        n, round_ = 0, 0
        while True:
            for row in trace.rows:
                yield [Prompt(self._trace_tokens(trace, row, round_), trace_max_tokens(trace, row),
                              f"h{row.hash_ids[0]}", n, 0, row=row, round_=round_)]
                n += 1
            round_ += 1

    @property
    def template_tokens(self) -> int:
        """Tokens the chat template adds around a trace row's prompt."""
        return len(self._head) + len(self._tail)

    def _trace_tokens(self, trace: Trace, row: TraceRow, round_: int) -> TraceTokens:
        size = trace.block_tokens
        if not self._pool:
            ids = np.asarray(sorted({self.tok.tok.encode(" " + w)[0] for w in _single_token_words()}))
            rng = np.random.default_rng(trace.seed)
            # one int object per word, shared by every window: copying a prompt's ids then touches a
            # few hundred objects, not a million
            words = ids.tolist()
            self._pool = list(map(words.__getitem__, rng.integers(0, len(ids), _POOL + size).tolist()))
        tokens = trace_prompt_tokens(trace, row)
        # a window of a seeded pool of random word ids per trace block, at an offset fixed by the
        # block's id: the same id gives the same ids, two ids almost always differ (a cache of every
        # block would hold gigabytes); the block keys follow the ids even where two windows
        # coincide (keys.py)
        span = len(self._pool) - size
        at = [hash((trace.seed, round_, h)) % span for h in row.hash_ids[:-(-tokens // size)]]
        return TraceTokens(self._pool, self._head, self._tail, at, size, tokens)


class TraceTokens(Sequence[int]):
    """A trace prompt's token ids: the template's head, `trace` ids from windows of `size` ids of
    `pool` (at the offsets `at`), the template's tail. Made only where read: a twin run reads
    mostly their count (a prompt's keys follow its structure, keys.py, and its engine's KV events
    carry no ids), and 10,000 prompts of ~12,000 ids each took a seventh of a run to make
    (docs/benchmarks.md)."""

    __slots__ = ("_at", "_head", "_n", "_pool", "_size", "_tail", "_trace")

    def __init__(self, pool: list[int], head: list[int], tail: list[int], at: list[int], size: int,
                 trace: int) -> None:
        self._pool, self._head, self._tail, self._at, self._size, self._trace = pool, head, tail, at, size, trace
        self._n = len(head) + trace + len(tail)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                return self.ids(0, self._n)[i]
            return self.ids(start, stop) if start < stop else []
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError("prompt index out of range")
        return self.ids(j, j + 1)[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids(0, self._n))

    def ids(self, start: int, stop: int) -> list[int]:
        """The ids from `start` to `stop` (excluded), 0 <= start <= stop <= len."""
        head, size, pool, at = len(self._head), self._size, self._pool, self._at
        out = self._head[start:stop] if start < head else []
        a, b = max(start, head) - head, min(stop, head + self._trace) - head   # in the trace's ids
        while a < b:
            k, off = divmod(a, size)
            end = min(b - k * size, size)
            out += pool[at[k] + off:at[k] + end]
            a = k * size + end
        tail = head + self._trace
        if stop > tail:
            out += self._tail[max(start - tail, 0):stop - tail]
        return out


def trace_prompt_tokens(trace: Trace, row: TraceRow) -> int:
    """A trace row's prompt tokens inside the chat template: its input length, at most its blocks'."""
    return min(max(1, round(row.input_length * trace.params.token_scale)), trace.block_tokens * len(row.hash_ids))


def trace_max_tokens(trace: Trace, row: TraceRow) -> int:
    """A trace row's max_tokens: its output length."""
    return max(1, round(row.output_length * trace.params.token_scale))
