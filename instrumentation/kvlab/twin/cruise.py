"""A decode cruise: up to k identical pure-decode steps of one replica run as one event, when no
request waits and every running one decodes. The cluster decides and schedules a cruise
(`Cluster._cruise`) and settles it early when anything could read or change the replica;
`advance` is what the scheduler and block pool would have made of its steps one at a time,
so the fast-forward changes no figure (tests/test_twin.py holds that)."""

from __future__ import annotations

from kvlab.twin.flight import Flight
from kvlab.twin.replica import Replica


def advance(replica: Replica, j: int, dur: float, end: float, flights: dict[str, Flight]) -> None:
    """What `Scheduler.schedule` and `complete` make of j pure-decode steps, at once: blocks
    allocated, tokens counted, full blocks cached (their KV events held for the caller to publish);
    a request the last step finishes is in `replica.done`."""
    replica.cruise = None
    sched, pool = replica.sched, replica.pool
    bs = pool.block_size
    for req in sched.running:
        grow = -(-(req.num_computed + j) // bs) - len(req.blocks)
        if grow > 0:
            new = pool.allocate(grow)
            assert new is not None   # checked when the cruise started
            req.blocks.extend(new)
        before = req.num_computed // bs
        req.num_computed += j
        req.num_output += j
        req.num_tokens += j
        after = req.num_computed // bs
        if after > before:
            sched._cache_blocks(req, before, after)
        f = flights[req.id]
        f.gap_sum += j * dur
        f.gap_n += j
        f.gap_max = max(f.gap_max, dur)
        f.last_ms = end
        if req.num_output >= req.max_tokens:
            replica.done.append(f)   # finished by the last step: ends with it
    replica.steps += j
