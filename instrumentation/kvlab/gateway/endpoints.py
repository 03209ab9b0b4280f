"""What the gateway believes about each replica: load, block size, health, event-stream state.

Health is passive and active at once: a failed scrape or a refused connection counts as a
failure; `eject_after_failures` consecutive failures eject the replica (it is no longer a
candidate); after `readmit_after_s` the scraper probes it again and one success re-admits it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvlab.contract import Endpoint


@dataclass(slots=True)
class Backend:
    endpoint: Endpoint
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None       # from vllm:cache_config_info or KV events
    num_gpu_blocks: int | None = None
    inflight: int = 0                   # requests the gateway has open to it right now
    inflight_tokens: int = 0            # their prefill work: prompt minus predicted cached prefix
    pending_prefill_tokens: int = 0     # uncached prompt tokens sent and not yet past their first token
                                        # (gateway/prefill.py)
    prefill_ms_per_token: float | None = None   # learned from observed TTFTs (gateway/prefill.py)
    healthy: bool = True
    failures: int = 0                   # consecutive
    ejected_at: float | None = None
    ejections: int = 0
    last_scrape: float | None = None
    last_error: str | None = None
    events_state: str = "none"          # none | connecting | live | stale
    events_received: int = 0
    events_gaps: int = 0
    events_restarts: int = 0
    events_replayed: int = 0            # batches fetched from the replay endpoint (lost, or sent before we joined)
    routed: int = 0
    # unchecked | match | tokenizer-mismatch | unverified | engine (gateway/parity.py)
    tokenizer: str = "unchecked"
    tokenizer_detail: str | None = None
    name: str = field(init=False)       # the endpoint's (read for every candidate of every request)

    def __post_init__(self) -> None:
        self.name = self.endpoint.name

    @property
    def url(self) -> str:
        return self.endpoint.url


class Registry:
    """The replica set (updated by discovery) and their health bookkeeping."""

    def __init__(self, eject_after_failures: int = 3, readmit_after_s: float = 2.0) -> None:
        self.replicas: dict[str, Backend] = {}
        self.eject_after = max(1, eject_after_failures)
        self.readmit_after_s = readmit_after_s
        self.on_eject: Callable[[Backend], None] | None = None  # set by the server (metrics, index)

    def update(self, endpoints: list[Endpoint]) -> tuple[list[Backend], list[Backend]]:
        """Apply a complete endpoint set; returns (added, removed)."""
        new = {e.name: e for e in endpoints}
        removed = [r for n, r in self.replicas.items() if n not in new or new[n] != r.endpoint]
        for r in removed:
            del self.replicas[r.name]
        added = []
        for n, e in new.items():
            if n not in self.replicas:
                self.replicas[n] = Backend(e)
                added.append(self.replicas[n])
        return added, removed

    def candidates(self, include_prefill: bool = False) -> list[Backend]:
        """Healthy replicas a request can be served by; prefill-role ones only when P/D is off."""
        return [r for r in self.replicas.values()
                if r.healthy and (include_prefill or r.endpoint.role != "prefill")]

    def success(self, r: Backend) -> None:
        r.failures = 0
        r.last_error = None
        if not r.healthy:
            r.healthy = True
            r.ejected_at = None

    def failure(self, r: Backend, error: str) -> bool:
        """Count a failure; returns True when this one ejected the replica."""
        r.failures += 1
        r.last_error = error
        if not r.healthy:
            r.ejected_at = time.monotonic()   # probe again after another readmit_after_s
            return False
        if r.failures >= self.eject_after:
            r.healthy = False
            r.ejected_at = time.monotonic()
            r.ejections += 1
            if self.on_eject is not None:
                self.on_eject(r)
            return True
        return False

    def due_for_probe(self, r: Backend) -> bool:
        return r.healthy or (r.ejected_at is not None
                             and time.monotonic() - r.ejected_at >= self.readmit_after_s)
