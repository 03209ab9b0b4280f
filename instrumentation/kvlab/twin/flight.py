"""A request in the twin from its send to its last token: one record of what the event loop
tracks for it across the gateway's lease, a P/D handoff and chunked decoding's calls."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.engine.sim.scheduler import Request
from kvlab.gateway.prefill import Prefill
from kvlab.load.measure import Record
from kvlab.twin.feed import Prompt
from kvlab.twin.replica import Replica


@dataclass(slots=True)
class Flight:
    """One request from its send to its last token."""

    prompt: Prompt
    sent_ms: float
    replica: Replica
    req: Request
    prefill: Prefill
    work: int
    record: Record
    user: int | None
    last_ms: float = 0.0
    gap_sum: float = 0.0           # inter-token gaps: sum, count, worst
    gap_n: int = 0
    gap_max: float = 0.0
    decode: Replica | None = None  # a P/D prefill leg: the decode replica its answer goes on to
    offered: int = 0               # a P/D decode leg: prompt blocks the prefill replica offers to pull
    chunk: int = 0                 # chunked decoding: tokens per chunk (0: one call for the whole answer)
    done: int = 0                  # tokens the earlier chunks generated
    total: int = 0                 # the request's max_tokens
    out: list[int] | None = None   # the whole answer's tokens (a chunk's call generates a slice)
