"""Never a hang: the twin's event loop stops with an error, not a spin, when a run stops
advancing (a livelock in the twin or its settings): too many events at one virtual instant, or a
replica stepping again and again without scheduling anything while it has work."""

from __future__ import annotations

from kvlab.errors import TwinError
from kvlab.twin.replica import Replica

# this many events in a row at one virtual instant, or this many steps in a row of one replica
# that schedule nothing while it has work, mean the run stopped advancing
STALL_EVENTS = 1_000_000
STALL_STEPS = 10_000


class Watchdog:
    """Each replica's steps in a row that scheduled nothing, against a limit."""

    __slots__ = ("idle", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle: dict[Replica, tuple[int, int]] = {}   # (step, empty steps in a row to it)

    def idle_step(self, replica: Replica) -> str | None:
        """A step of a replica with work scheduled nothing: what is wrong once it is a livelock."""
        step, n = self.idle.get(replica, (-1, 0))
        n = n + 1 if step == replica.steps - 1 else 1
        self.idle[replica] = (replica.steps, n)
        if n < self.limit:
            return None
        sched = replica.sched
        return (f"replica {replica.name} stepped {n:,} times in a row scheduling nothing, with "
                f"{len(sched.waiting)} waiting and {len(sched.running)} running requests and "
                f"{replica.pool.num_free} of {replica.pool.num_blocks} KV blocks free")


def stalled(now_ms: float, finished: int, in_flight: int, what: str) -> TwinError:
    """The error a stopped run ends with."""
    return TwinError(f"the twin stopped advancing at {now_ms / 1000.0:,.3f} s of virtual time: {what} "
                     f"({finished:,} requests finished, {in_flight:,} in flight). "
                     "This is a livelock in the twin or its settings; please report it with the command")
