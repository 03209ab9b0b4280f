"""One simulated replica in the twin: the simulator's scheduler and block pool, and the gateway's
view of it (`Backend`), stepped by the cluster's event loop instead of an asyncio task. The ranks
of a data-parallel (or MoE) replica step together (`Lockstep`), as `kvlab engine sim` runs them."""

from __future__ import annotations

from typing import Any, cast

from kvlab.contract import Endpoint
from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.dp import LockstepGroup, lockstep_group
from kvlab.engine.sim.profile import LatencyProfile
from kvlab.engine.sim.runpool import RunPool
from kvlab.engine.sim.sampler import Sampler
from kvlab.engine.sim.scheduler import Batch, Scheduler
from kvlab.gateway.endpoints import Backend
from kvlab.tokenizer import Tokenizer
from kvlab.topology import SimSettings
from kvlab.twin.settings import Member, Plan


class Replica:
    """Engine state of one replica (or one rank); `step_ms` is the live engine's step-time model."""

    __slots__ = ("backend", "batch", "busy", "cruise", "done", "events", "gen", "group", "name", "pool", "profile",
                 "scale", "sched", "steps")

    def __init__(self, member: Member, profile: LatencyProfile, sim: SimSettings, num_blocks: int,
                 events: bool, runs: bool) -> None:
        self.name = member.name
        self.profile = profile
        self.scale = sim.time_scale
        # by key runs where a trace's keys ascend, untyped and GPU only: a RunPool answers the
        # BlockPool calls the scheduler and a P/D pull make, its blocks a `Held` used as the list is
        self.pool = cast(BlockPool, RunPool(num_blocks, sim.block_size, events=events)) if runs else \
            BlockPool(num_blocks, sim.block_size, events=events, cpu_blocks=sim.cpu_kv_blocks or profile.cpu_kv_blocks,
                      pinned_share=sim.typed_retention)
        # the gateway's own hash family (seed 0), unlike `kvlab engine sim`'s per-rank seeds: a
        # prompt is hashed once, by the router, and the KV events carry the gateway's keys (no
        # figure depends on a key's value); its index reads keys only: no token ids in the KV events
        self.sched = Scheduler(self.pool, sim.max_num_seqs, sim.max_num_batched_tokens, hash_seed=0, token_ids=False)
        self.backend = Backend(Endpoint(name=self.name, url=f"twin://{self.name}",
                                        kv_events=f"twin://{self.name}/events" if events else None,
                                        role=member.role, dp_rank=member.dp_rank, replica=member.replica))
        self.backend.block_size = sim.block_size            # what the first scrape tells the gateway
        self.backend.num_gpu_blocks = num_blocks
        self.events = events              # KV events published (a precise-index policy)
        self.busy = False
        self.batch: Batch | None = None
        self.cruise: tuple[float, float, int] | None = None   # (start ms, step ms, steps) of a decode cruise
        self.gen = 0                       # which cruise end event is current
        self.done: list[Any] = []          # flights a decode cruise finishes (cruise.py)
        self.steps = 0
        self.group: Lockstep | None = None   # the ranks it steps with, if any

    def start_step(self) -> float:
        """Schedule the next batch; its modelled duration in ms."""
        b = self.sched.schedule()
        self.batch = b
        self.busy = True
        self.steps += 1
        return self.profile.step_ms(b.prefill_tokens, b.decode_seqs, b.prefill_ctx_k, len(b.admitted),
                                    b.loaded_blocks) * self.scale

    def scrape(self) -> None:
        """What a /metrics scrape would tell the gateway now (gateway/loadview.py `apply_metrics`)."""
        r = self.backend
        r.waiting = float(len(self.sched.waiting))
        r.running = float(len(self.sched.running))
        r.kv_usage = self.pool.usage


class Lockstep:
    """The ranks of one replica stepping together: every rank schedules a batch (an idle one an
    empty batch, the live dummy step) and the step lasts what the live `LockstepGroup.cost` says
    for all of them: the busiest rank's dense time plus the MoE layers' (engine/sim/dp.py)."""

    __slots__ = ("group", "ranks")

    def __init__(self, group: LockstepGroup, ranks: list[Replica]) -> None:
        self.group = group
        self.ranks = ranks
        for r in ranks:
            r.group = self

    def start_step(self) -> float:
        """Schedule every rank's batch; the group step's duration in ms."""
        batches = []
        for r in self.ranks:
            b = r.sched.schedule()
            r.batch = b
            r.busy = True
            r.steps += 1
            batches.append(b)
        return self.group.cost(batches) * self.group.time_scale


def join_ranks(plan: Plan, replicas: list[Replica], tok: Tokenizer) -> Sampler | None:
    """Join each data-parallel (or MoE) replica's ranks in a `Lockstep` built as `kvlab engine
    sim` builds its group; with an MoE model, the live sampler's output tokens (the experts a
    decode token goes to depend on its id)."""
    groups: dict[str, list[Replica]] = {}
    for m, r in zip(plan.members, replicas):
        groups.setdefault(m.replica or m.name, []).append(r)
    moe = False
    for ranks in groups.values():
        lock = lockstep_group(plan.profile, plan.sim.time_scale, tok, len(ranks))
        if lock is not None:
            Lockstep(lock, ranks)
            moe = moe or lock.moe is not None
    return Sampler(tok, plan.sim.seed) if moe else None
