"""Prefill work each replica still has to do, and what a prefill token costs there.

The gateway counts, per replica, the uncached prompt tokens (prompt minus the predicted cached
prefix) of the requests it sent there that have not produced a first token yet: queued and
running prefills alike, each released at its first streamed token (or when the response ends
without one). That is the work a new request would wait behind, which a request count or the
scraped queue length cannot weigh: one 4,000-token miss outweighs ten cache hits.

The per-token cost is learned online from the TTFTs the gateway observes: a request's TTFT
covers the prefill work ahead of it at dispatch plus its own, so each first token gives a sample
`ttft / (work ahead + own work)` (ms per token, queueing and per-step overhead included), folded
into an exponentially weighted moving average per replica. Small prefills are skipped: their
TTFT is mostly fixed overhead and would inflate the per-token figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvlab.gateway.endpoints import Backend


@dataclass(slots=True)
class Prefill:
    """One dispatched request's prefill, from dispatch to its first token."""

    replica: Backend
    tokens: int          # its uncached prompt tokens
    ahead: int           # the replica's pending prefill tokens when it was dispatched
    started: float       # perf_counter at dispatch
    done: bool = False


class PrefillBook:
    def __init__(self, alpha: float = 0.2, min_tokens: int = 64) -> None:
        self.alpha = alpha
        self.min_tokens = min_tokens

    def start(self, r: Backend, tokens: int) -> Prefill:
        p = Prefill(r, tokens, r.pending_prefill_tokens, time.perf_counter())
        r.pending_prefill_tokens += tokens
        return p

    def first_token(self, p: Prefill, now: float | None = None) -> None:
        """The first token arrived: the prefill is done, and its TTFT is a cost sample."""
        if p.done:
            return
        self._release(p)
        work = p.tokens + p.ahead
        if work < self.min_tokens:
            return
        ms = ((time.perf_counter() if now is None else now) - p.started) * 1000.0 / work
        r = p.replica
        r.prefill_ms_per_token = ms if r.prefill_ms_per_token is None else \
            (1 - self.alpha) * r.prefill_ms_per_token + self.alpha * ms

    def finish(self, p: Prefill) -> None:
        """The response ended (or failed) without a first token seen: release its work."""
        if not p.done:
            self._release(p)

    @staticmethod
    def _release(p: Prefill) -> None:
        p.done = True
        p.replica.pending_prefill_tokens = max(0, p.replica.pending_prefill_tokens - p.tokens)
