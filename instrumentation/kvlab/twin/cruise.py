"""A decode cruise: up to k identical pure-decode steps of one replica run as one event, when no
request waits and every running one decodes. `cruise_steps` says how many steps a cruise may
take; the cluster schedules it (`Cluster._cruise`) and settles it early when anything could read
or change the replica; `advance` is what the scheduler and block pool would have made of its
steps one at a time, so the fast-forward changes no figure (tests/test_twin.py holds that)."""

from __future__ import annotations

from kvlab.twin.flight import Flight
from kvlab.twin.replica import Replica


def cruise_steps(replica: Replica) -> int:
    """How many identical pure-decode steps the replica can run as one event now: until the first
    running request finishes, when none waits, every running one decodes and there are free
    blocks for all (a CPU tier or typed retention: none); 0 when fewer than 2."""
    sched, pool = replica.sched, replica.pool
    running = sched.running
    if sched.waiting or not running or pool.tier is not None or pool.typed is not None:
        return 0
    for req in running:
        if req.num_output == 0 or req.num_computed != req.num_tokens - 1:
            return 0
    k = min(req.max_tokens - req.num_output for req in running)
    if k < 2:
        return 0
    bs = pool.block_size
    if sum(-(-(req.num_computed + k) // bs) - len(req.blocks) for req in running) > pool.num_free:
        return 0
    return k


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
