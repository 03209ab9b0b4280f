"""trace: a production request trace replayed (Mooncake's JSONL format), its prefix structure kept.

Each line of a Mooncake trace is one request: `timestamp` (ms since the trace start),
`input_length` / `output_length` (tokens) and `hash_ids`, one id per 512-token block of the
prompt; two requests that share a leading run of ids share that prefix. The trace carries no
text, so the prompt is rebuilt from the ids: every id stands for one block of `512 × token_scale`
tokens, drawn from kvlab's single-token words and seeded by the id, and a prompt is its blocks in
order (the last one cut to the request's scaled length). Requests that share leading ids therefore
share exactly those token blocks, whatever block size the engine hashes with; requests that do
not, differ from their first block on. Completion lengths scale by the same factor.

The two traces of Mooncake's FAST'25 release have names: `mooncake-conversation` and
`mooncake-synthetic` resolve to conversation_trace.jsonl / synthetic_trace.jsonl in
`$KVLAB_TRACES_DIR` (default ~/.cache/kvlab/traces; docs/open-loop.md says where to download
them). Any other file of the format is given by its path. The whole file is parsed when the
workload is made, so a missing file or a bad line fails before anything starts, naming the line.

Sessions are the trace's rows in order, one request each (after the last row the trace starts
again, a new round of block texts); `offsets` are the send times an open-loop replay keeps.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Annotated

import msgspec

from kvlab.errors import ConfigError
from kvlab.load.workloads.base import Params, Workload, WorkloadRequest
from kvlab.tokenizer import Tokenizer, words

TRACE_BLOCK_TOKENS = 512   # Mooncake hashes 512-token blocks
NAMED = {"mooncake-conversation": "conversation_trace.jsonl", "mooncake-synthetic": "synthetic_trace.jsonl"}
SOURCE = "https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces"


class TraceRow(msgspec.Struct, forbid_unknown_fields=False):
    """One line of a Mooncake trace (other keys are ignored)."""

    timestamp: Annotated[int, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=1)]
    hash_ids: Annotated[list[int], msgspec.Meta(min_length=1)]


def traces_dir() -> Path:
    """Where the named traces live: $KVLAB_TRACES_DIR, else ~/.cache/kvlab/traces."""
    return Path(os.environ.get("KVLAB_TRACES_DIR") or Path.home() / ".cache" / "kvlab" / "traces")


def resolve(name_or_path: str) -> Path:
    """A trace by name (mooncake-conversation, mooncake-synthetic) or by path; it must exist."""
    if name_or_path in NAMED:
        path = traces_dir() / NAMED[name_or_path]
        if not path.is_file():
            raise ConfigError(f"trace {name_or_path}: {path} does not exist; download {NAMED[name_or_path]} from "
                              f"{SOURCE} into {path.parent} (or set KVLAB_TRACES_DIR), see docs/open-loop.md")
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        what = ("a directory" if path.is_dir() else "not a regular file" if path.exists()
                else "no such file")
        raise ConfigError(f"trace {name_or_path}: {what}; a trace is a Mooncake JSONL file "
                          f"or one of the names {', '.join(NAMED)}")
    return path.absolute()


_decoder = msgspec.json.Decoder(TraceRow)


@lru_cache(maxsize=4)
def read_trace(path: str) -> tuple[TraceRow, ...]:
    """Every row of a Mooncake JSONL trace; a bad line is a ConfigError naming it."""
    rows: list[TraceRow] = []
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"trace {path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = _decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"trace {path}, line {number}: {exc}") from None
        if len(row.hash_ids) != math.ceil(row.input_length / TRACE_BLOCK_TOKENS):
            raise ConfigError(f"trace {path}, line {number}: {len(row.hash_ids)} hash_ids for input_length "
                              f"{row.input_length} (one id per {TRACE_BLOCK_TOKENS}-token block)")
        if rows and row.timestamp < rows[-1].timestamp:
            raise ConfigError(f"trace {path}, line {number}: timestamp {row.timestamp} is before the previous "
                              f"line's {rows[-1].timestamp}")
        rows.append(row)
    if not rows:
        raise ConfigError(f"trace {path}: no requests in it")
    return tuple(rows)


@lru_cache(maxsize=1)
def _single_token_words() -> tuple[str, ...]:
    """Words that are one token each, with a leading space too: a block of n of them is n tokens."""
    tok = Tokenizer()
    return tuple(sorted(w for w in set(words()) if len(tok.encode(f"{w} {w}")) == 2))


class TraceParams(Params, frozen=True):
    path: str = ""
    token_scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("the trace workload needs a path (kvlab ... --trace NAME|FILE)")


class Trace(Workload[TraceParams]):
    name = "trace"
    Params = TraceParams

    @cached_property
    def rows(self) -> tuple[TraceRow, ...]:
        return read_trace(str(resolve(self.params.path)))

    def __init__(self, seed: int = 0, params: dict[str, object] | TraceParams | None = None) -> None:
        super().__init__(seed, params)
        _ = self.rows   # parsed now: a bad trace fails before anything starts
        self._blocks: dict[tuple[int, int], list[str]] = {}

    @property
    def block_tokens(self) -> int:
        """Tokens per trace block after scaling (at least one)."""
        return max(1, round(TRACE_BLOCK_TOKENS * self.params.token_scale))

    def block(self, hash_id: int, round_: int = 0) -> list[str]:
        """The words of one block: the same for the same id, seeded by it."""
        key = (hash_id, round_)
        if key not in self._blocks:
            rng = random.Random(f"{self.seed}:trace-block:{round_}:{hash_id}")
            vocab = _single_token_words()
            self._blocks[key] = [rng.choice(vocab) for _ in range(self.block_tokens)]
        return self._blocks[key]

    def request(self, row: TraceRow, round_: int = 0) -> WorkloadRequest:
        """One row as a chat request: its blocks' words, cut to the scaled input length."""
        scale, size = self.params.token_scale, self.block_tokens
        tokens = min(max(1, round(row.input_length * scale)), size * len(row.hash_ids))
        whole, rest = divmod(tokens, size)
        chosen: list[str] = []
        for i, h in enumerate(row.hash_ids[:whole + (1 if rest else 0)]):
            chosen.extend(self.block(h, round_) if i < whole else self.block(h, round_)[:rest])
        return WorkloadRequest(messages=[{"role": "user", "content": " ".join(chosen)}],
                               max_tokens=max(1, round(row.output_length * scale)), group=f"h{row.hash_ids[0]}")

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        round_ = 0
        while True:
            for row in self.rows:
                yield [self.request(row, round_)]
            round_ += 1

    @property
    def rate(self) -> float:
        """The trace's own mean arrival rate (requests/s over its span)."""
        span_s = (self.rows[-1].timestamp - self.rows[0].timestamp) / 1000
        return (len(self.rows) - 1) / span_s if span_s > 0 else float(len(self.rows))

    def offsets(self, time_scale: float) -> Iterator[float]:
        """Each row's send time in seconds from the first, times `time_scale` (2: half the rate)."""
        first = self.rows[0].timestamp
        return ((row.timestamp - first) / 1000 * time_scale for row in self.rows)
