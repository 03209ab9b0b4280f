"""Offline replay in virtual time: a workload routed by the gateway's scheduler onto simulated
data-parallel ranks stepping in lockstep, with no clock, sockets or HTTP.

It runs the real parts (the gateway's `Ranker` with its scorers and picker, the simulator's
`Scheduler`/`BlockPool` per rank, `dp.LockstepGroup`'s step cost with the MoE model) and only
replaces time: arrivals and step ends are processed in order of virtual time. The router sees
what the live gateway would see with a precise KV-event index and fresh scrapes: each rank's
cached prefix, waiting queue, KV usage, in-flight requests and in-flight prefill tokens.
Used by tests (same seed -> same result) and benchmarks/wide_ep_routing.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvlab.contract import Endpoint
from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.dp import LockstepGroup
from kvlab.engine.sim.engine import Engine
from kvlab.engine.sim.moe import MoeModel
from kvlab.engine.sim.profile import LatencyProfile
from kvlab.engine.sim.scheduler import FINISHED, Batch, Request, Scheduler
from kvlab.gateway.endpoints import Backend as Target
from kvlab.gateway.scheduler.base import Ranker as Router
from kvlab.gateway.scheduler.base import RouteRequest


@dataclass(frozen=True, slots=True)
class Arrival:
    t_ms: float
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class RankResult:
    name: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    peak_waiting: int = 0
    waiting_ms: float = 0.0       # integral of the waiting queue over time (request x ms)


@dataclass(slots=True)
class ReplayResult:
    ranks: dict[str, RankResult]
    ttft_ms: list[float] = field(default_factory=list)
    makespan_ms: float = 0.0
    moe_wait_ms: float = 0.0      # sum over steps of the time waiting for the slowest EP rank
    dp_wait_ms: float = 0.0       # sum over steps and ranks of idling for the busiest DP rank

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.ranks.values())
        return sum(r.cached_tokens for r in self.ranks.values()) / prompt if prompt else 0.0

    @property
    def worst_peak_waiting(self) -> int:
        return max(r.peak_waiting for r in self.ranks.values())

    @property
    def worst_mean_waiting(self) -> float:
        return max(r.waiting_ms for r in self.ranks.values()) / self.makespan_ms if self.makespan_ms else 0.0

    @property
    def mean_ttft_ms(self) -> float:
        return sum(self.ttft_ms) / len(self.ttft_ms) if self.ttft_ms else 0.0


def shared_prefix_workload(seed: int, n: int, groups: int = 8, prefix_tokens: int = 1024,
                           suffix_tokens: tuple[int, int] = (32, 256), max_tokens: tuple[int, int] = (8, 48),
                           rate_per_s: float = 20.0, vocab: int = 2048) -> list[Arrival]:
    """`n` requests, Poisson arrivals; each starts with one of `groups` shared prefixes (a system
    prompt or document) followed by a unique question."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_tokens)] for _ in range(groups)]
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s) * 1000.0
        suffix = [rng.randrange(vocab) for _ in range(rng.randint(*suffix_tokens))]
        out.append(Arrival(t, prefixes[rng.randrange(groups)] + suffix, rng.randint(*max_tokens)))
    return out


class _Rank:
    def __init__(self, name: str, replica: str | None, dp_rank: int | None, engine: Engine, target: Target) -> None:
        self.name = name
        self.engine = engine
        self.sched: Scheduler = engine.scheduler
        self.target = target
        self.result = RankResult(name)
        self.inflight: dict[str, int] = {}   # request id -> prefill tokens the router counted


def replay(arrivals: list[Arrival], router: Router, profile: LatencyProfile, *, replicas: int = 1,
           data_parallel_size: int = 4, num_blocks: int | None = None, max_num_seqs: int | None = None,
           vocab: int = 2048, seed: int = 0) -> ReplayResult:
    """Route `arrivals` with `router` onto `replicas` x `data_parallel_size` ranks; run to the end."""
    rng = random.Random(seed)
    bs = profile.block_size
    moe = MoeModel(profile.moe, vocab) if profile.moe is not None else None
    groups: list[tuple[LockstepGroup, list[_Rank]]] = []
    for i in range(replicas):
        group = LockstepGroup(profile, 1.0, moe)
        ranks = []
        for r in range(data_parallel_size):
            pool = BlockPool(num_blocks or profile.num_blocks, bs, events=False)
            sched = Scheduler(pool, max_num_seqs or profile.max_num_seqs, profile.max_num_batched_tokens,
                              hash_seed=i * data_parallel_size + r + 1)
            eng = group.member(r, sched, profile, 1.0, None)
            name = f"sim-{i}-dp{r}"
            ep = Endpoint(name=name, url=f"replay://{name}", dp_rank=r, replica=f"sim-{i}")
            ranks.append(_Rank(name, ep.replica, r, eng, Target(ep, block_size=bs, num_gpu_blocks=pool.num_blocks)))
        groups.append((group, ranks))
    all_ranks = [rk for _, ranks in groups for rk in ranks]
    result = ReplayResult({rk.name: rk.result for rk in all_ranks})
    busy_until: list[float | None] = [None] * len(groups)     # end of the step in progress
    batches: list[list[Batch] | None] = [None] * len(groups)
    pending = sorted(arrivals, key=lambda a: a.t_ms)
    nxt, now, last = 0, 0.0, 0.0
    ids = 0

    def account(t: float) -> None:
        nonlocal last
        for rk in all_ranks:
            rk.result.waiting_ms += len(rk.sched.waiting) * (t - last)
        last = t

    while nxt < len(pending) or any(b is not None for b in busy_until) or any(
            rk.sched.has_work() for rk in all_ranks):
        # the next event: an arrival, or the earliest step end
        t_step = min((b for b in busy_until if b is not None), default=None)
        t_arr = pending[nxt].t_ms if nxt < len(pending) else None
        if t_arr is not None and (t_step is None or t_arr <= t_step):
            account(t_arr)
            now = t_arr
            a = pending[nxt]
            nxt += 1
            ids += 1
            _route(router, all_ranks, a, f"r{ids}", now, rng)
        elif t_step is not None:
            account(t_step)
            now = t_step
            for gi, b in enumerate(busy_until):
                if b is not None and b <= now:
                    _finish_step(groups[gi], batches[gi], now, result)
                    busy_until[gi] = batches[gi] = None
        # idle groups with work start a step now
        for gi, (group, ranks) in enumerate(groups):
            if busy_until[gi] is None and any(rk.sched.has_work() for rk in ranks):
                bs_ = [rk.sched.schedule() for rk in ranks]
                for rk, batch in zip(ranks, bs_):
                    for req in batch.admitted:
                        req.t_scheduled = int(now * 1e6)
                        rk.result.cached_tokens += req.num_cached or 0
                ms = group.cost(bs_)
                result.dp_wait_ms += sum(max(group.last_dense) - d for d in group.last_dense)
                if group.last_moe is not None:
                    result.moe_wait_ms += group.last_moe.wait_ms
                busy_until[gi] = now + ms
                batches[gi] = bs_
        if nxt >= len(pending) and all(b is None for b in busy_until) and not any(
                rk.sched.has_work() for rk in all_ranks):
            break
    result.makespan_ms = now
    return result


def _route(router: Router, ranks: list[_Rank], a: Arrival, rid: str, now: float, rng: random.Random) -> None:
    for rk in ranks:
        t = rk.target
        t.waiting = float(len(rk.sched.waiting))
        t.running = float(len(rk.sched.running))
        t.kv_usage = rk.sched.pool.usage
        t.inflight = len(rk.inflight)
        t.inflight_tokens = sum(rk.inflight.values())
    prefix = {}
    for rk in ranks:
        keys = rk.sched.prompt_keys(a.prompt)
        prefix[rk.name] = len(rk.sched.pool.cached_prefix(keys[:(len(a.prompt) - 1) // rk.sched.block_size])) \
            * rk.sched.block_size
    decision = router.schedule(RouteRequest(len(a.prompt)), [rk.target for rk in ranks], prefix)
    rk = next(r for r in ranks if r.name == decision.chosen.name)
    output = [rng.randrange(2048) for _ in range(a.max_tokens)]
    req = Request(rid, a.prompt, output, rk.sched.prompt_keys(a.prompt))
    req.t_arrival = int(now * 1e6)
    rk.sched.add(req)
    rk.inflight[rid] = len(a.prompt) - decision.chosen.prefix_tokens
    rk.result.requests += 1
    rk.result.prompt_tokens += len(a.prompt)
    rk.result.peak_waiting = max(rk.result.peak_waiting, len(rk.sched.waiting))


def _finish_step(group: tuple[LockstepGroup, list[_Rank]], batches: list[Batch] | None, now: float,
                 result: ReplayResult) -> None:
    assert batches is not None  # a group busy until now stepped these batches
    lockstep, ranks = group
    for rk, b in zip(ranks, batches):
        for req in rk.sched.complete(b):
            if req.num_output == 1:
                result.ttft_ms.append(now - req.t_arrival / 1e6)
            if req.status == FINISHED:
                rk.inflight.pop(req.id, None)
                lockstep.stats.pop(req.id, None)   # what the live server's span would have taken
