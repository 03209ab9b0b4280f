"""KV-event feeds: one ZMQ subscriber per replica feeding the precise index.

States (shown in /debug/endpoints): `connecting` until the first batch, `live`, and `stale`
after a sequence gap (events were lost, so the replica's precise entries are dropped and the
router uses the approximate index for it) until `resync_s` of gap-free events have rebuilt it.
When the replica has a replay endpoint (vLLM's `replay_endpoint`, the simulator's), the lost
batches are fetched from it first: once they all arrive the gap is closed and the index never
goes stale. The same endpoint catches a new subscriber up: ZMQ drops what a publisher sends before
a subscription reaches it (the slow joiner), so the first batch heard is often not the first one
sent, and blocks stored before it would stay unknown (and so would every block chained onto them).
The batches the replica still holds from before the first one heard are applied first; a reset
among them leaves the speculative blocks of the requests this gateway has routed there meanwhile
(they came after it), so a replica whose first batches are still on their way is not taken for
empty the moment its feed goes live.
A sequence going backwards means the engine restarted with an empty cache: both indexes forget
that replica. A dead or silent stream never blocks serving: the feed is a background task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvlab.gateway.endpoints import Backend
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
from kvlab.kvcache.transport import EventSubscriber, Received

log = logging.getLogger(__name__)


class EventFeed:
    def __init__(self, precise: PreciseIndex, approx: ApproximateIndex, resync_s: float = 10.0,
                 on_batch: Callable[[Backend, Received], None] | None = None) -> None:
        self.precise = precise
        self.approx = approx
        self.resync_s = resync_s
        self.on_batch = on_batch
        self._stale_since: dict[str, float] = {}

    def ingest(self, r: Backend, rec: Received, caught_up: bool = False) -> None:
        """Apply one received batch, handling gaps and restarts first; `caught_up`: one from before
        the subscription (see the module docstring)."""
        name = r.name
        if rec.restarted:
            r.events_restarts += 1
            self.precise.clear(name)
            self.approx.clear(name)
            log.warning("KV events of %s restarted (seq %d): index cleared", name, rec.seq)
        elif rec.gap:
            r.events_gaps += 1
            self.precise.clear(name)
            self._stale_since[name] = time.monotonic()
            r.events_state = "stale"
            log.warning("KV events of %s: %d batches lost; precise entries dropped, resyncing", name, rec.gap)
        self.precise.apply(name, rec.batch.events, keep_speculative=caught_up)
        r.events_received += 1
        if r.events_state != "live":
            since = self._stale_since.get(name)
            if since is None or time.monotonic() - since >= self.resync_s:
                self._stale_since.pop(name, None)
                r.events_state = "live"
        if self.on_batch is not None:
            self.on_batch(r, rec)

    async def run(self, r: Backend) -> None:
        """Subscribe to `r.endpoint.kv_events` until cancelled."""
        assert r.endpoint.kv_events
        sub = EventSubscriber(r.endpoint.kv_events, replay=r.endpoint.kv_replay)
        r.events_state = "connecting"
        n = 0
        try:
            while True:
                rec = await sub.recv()
                if n == 0 and rec.seq > 0:
                    await self._catch_up(r, sub, rec.seq)
                elif rec.gap and not rec.restarted:
                    lost = await sub.replay(rec.seq - rec.gap, rec.seq)
                    if lost is not None:
                        r.events_replayed += len(lost)
                        for old in lost:
                            self.ingest(r, old)
                        rec.gap = 0
                        log.info("KV events of %s: %d lost batches replayed", r.name, len(lost))
                try:
                    self.ingest(r, rec)
                except Exception as exc:  # a bad batch must not kill the feed
                    log.warning("KV events of %s: batch %d ignored: %s", r.name, rec.seq, exc)
                n += 1
                if n % 64 == 0:
                    await asyncio.sleep(0)   # a flood of events must not starve request handling
        finally:
            sub.close()

    async def _catch_up(self, r: Backend, sub: EventSubscriber, first: int) -> None:
        """Apply what the replica still holds from before the first batch heard (`first`)."""
        earlier = await sub.replay(0, first, timeout_s=2.0, partial=True)
        for i, old in enumerate(earlier or ()):
            try:
                self.ingest(r, old, caught_up=True)
            except Exception as exc:  # as a live batch: a bad one is skipped
                log.warning("KV events of %s: batch %d ignored: %s", r.name, old.seq, exc)
            if i % 64 == 63:
                await asyncio.sleep(0)   # up to a whole replay buffer: let requests be served between
        if earlier:
            r.events_replayed += len(earlier)
            log.info("KV events of %s: caught up on %d batches sent before the subscription", r.name, len(earlier))
