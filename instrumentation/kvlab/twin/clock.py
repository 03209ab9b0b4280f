"""The twin's virtual clock: what happens next, in time order, and when "now" is.

Two queues: the clients' side (a send, a request reaching its replica) and the engines' side (a
step or a cruise ending, KV events landing, a scrape, a KV transfer, a lockstep group's step).
The loop (`Cluster.run`) reads the earlier head of the two; among events at one instant, the one
pushed first goes first, so a run is the same every time.
"""

from __future__ import annotations

from heapq import heappush

SEND, SUBMIT, STEP, EVENTS, SCRAPE, CRUISE, TRANSFER, LOCKSTEP = range(8)

Entry = tuple[float, int, int, object]   # (virtual ms, push order, kind, what)


class Clock:
    """The current virtual time in ms, and the events still to come."""

    __slots__ = ("_seq", "heap", "intake", "now_ms")

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.heap: list[Entry] = []     # engine-side events
        self.intake: list[Entry] = []   # sends and submits
        self._seq = 0

    def push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heappush(self.intake if kind <= SUBMIT else self.heap, (t, self._seq, kind, obj))

    def seconds(self) -> float:
        """Now in seconds: the clock the gateway's parts read (its index, its slot queues)."""
        return self.now_ms / 1000.0
