"""Pending-prefill scorer: fewer prompt tokens still to prefill on the replica is better.

Counts work, not requests: the uncached prompt tokens of the requests the gateway sent there that
have not produced a first token yet (queued and running; `gateway/prefill.py`), so a replica
busy with one long cache miss scores worse than one serving several cache hits."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer, normalised_inverse
from kvlab.gateway.scheduler.registry import plugin


@plugin
class PendingPrefillScorer(Scorer):
    name = "pending_prefill"

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return normalised_inverse([float(c.replica.pending_prefill_tokens) for c in candidates])
