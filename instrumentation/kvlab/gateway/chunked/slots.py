"""Per-replica chunk slots: which waiting chunk runs next.

A chunked request holds a slot only while one chunk runs; between chunks it queues again, so
the order of the queue is the scheduling policy: the best class first (a waiting chunk's class
improves by one per `aging_s` waited, so nothing starves), within a class the tenant that got
the fewest slots (virtual time, as in fair queueing), then arrival. The last `reserved_slots`
slots are kept for the best class, so an interactive request finds one free while long
low-priority generations hold the rest. The queue itself only calls a ticket's `on_grant`: the
gateway awaits a future (`acquire`), the cluster twin schedules the chunk's call in virtual time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

CLASSES = ("high", "normal", "low")     # rank 0 is served first


def class_rank(value: str | None) -> int:
    """The rank of a priority header value (`high`, `normal`, `low` or 0..2); unknown -> normal."""
    if value is None:
        return 1
    v = value.strip().lower()
    if v in CLASSES:
        return CLASSES.index(v)
    if v.isdigit():
        return min(int(v), len(CLASSES) - 1)
    return 1


@dataclass(eq=False)
class Ticket:
    """One chunk waiting for a slot."""

    rank: int
    tenant: str
    seq: int
    since: float
    on_grant: Callable[[], None]
    granted: bool = False
    passed_by_better: bool = False        # a better-class chunk was granted while this one waited


class SlotQueue:
    """The chunk slots of one replica."""

    def __init__(self, slots: int, reserved: int, aging_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.reserved = min(reserved, slots - 1)
        self.aging_s = aging_s
        self.clock = clock
        self.busy = 0
        self.waiting: list[Ticket] = []
        self._vtime: dict[str, float] = {}
        self._seq = itertools.count()

    def effective_rank(self, t: Ticket, now: float) -> int:
        aged = int((now - t.since) / self.aging_s) if self.aging_s > 0 else 0
        return max(0, t.rank - aged)

    def _admissible(self, rank: int) -> bool:
        limit = self.slots if rank == 0 else self.slots - self.reserved
        return self.busy < limit

    def _key(self, t: Ticket, now: float) -> tuple[int, float, int]:
        return (self.effective_rank(t, now), self._vtime.get(t.tenant, 0.0), t.seq)

    def _grant(self, t: Ticket) -> None:
        self.busy += 1
        floor = min(self._vtime.values(), default=0.0)
        self._vtime[t.tenant] = max(self._vtime.get(t.tenant, floor), floor) + 1.0
        t.granted = True
        t.on_grant()

    def pump(self) -> None:
        """Grant free slots to the best admissible waiters."""
        now = self.clock()
        while self.waiting:
            best = min(self.waiting, key=lambda t: self._key(t, now))
            rank = self.effective_rank(best, now)
            if not self._admissible(rank):
                return
            self.waiting.remove(best)
            for other in self.waiting:
                if self.effective_rank(other, now) > rank:
                    other.passed_by_better = True
            self._grant(best)

    def enqueue(self, rank: int, tenant: str, on_grant: Callable[[], None]) -> Ticket:
        """Queue a chunk (`pump` grants it a slot, maybe at once); `on_grant` is called with it."""
        t = Ticket(rank, tenant, next(self._seq), self.clock(), on_grant)
        self.waiting.append(t)
        return t

    async def acquire(self, rank: int, tenant: str) -> tuple[float, str]:
        """Wait for a slot; returns (seconds waited, hold reason: none | slots-busy | yield-to-higher | reserved)."""
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not granted.done():     # not cancelled: the client still waits
                granted.set_result(None)

        t = self.enqueue(rank, tenant, wake)
        self.pump()
        held = not t.granted
        reserved = held and self.busy < self.slots
        try:
            await granted
        except asyncio.CancelledError:
            if t in self.waiting:
                self.waiting.remove(t)
            elif t.granted:
                self.release()      # granted, but the client went away before using it
            raise
        waited = self.clock() - t.since
        if not held:
            return waited, "none"
        if reserved:
            return waited, "reserved"
        return waited, "yield-to-higher" if t.passed_by_better else "slots-busy"

    def release(self) -> None:
        self.busy -= 1
        self.pump()
