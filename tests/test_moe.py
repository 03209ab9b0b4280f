"""The MoE model of the simulator: deterministic gating, the slowest-EP-rank cost, lockstep DP
ranks, and the `engine.moe_dispatch` span (docs/wide-ep.md)."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import numpy as np
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import span_role
from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.engine.sim.dp import LockstepGroup
from kvlab.engine.sim.moe import MoeModel, MoeSpec, MoeStats
from kvlab.engine.sim.profile import get_profile
from kvlab.engine.sim.scheduler import Request, Scheduler
from kvlab.errors import ConfigError
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing

SPEC = MoeSpec(experts=8, top_k=2, ep_ranks=4, expert_ms_per_token=0.5, dispatch_ms=1.0)


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exp))
    return exp


def test_gating_is_deterministic_top_k_distinct_and_skew_makes_hot_experts():
    a, b = MoeModel(SPEC, 512), MoeModel(SPEC, 512)
    assert np.array_equal(a.table, b.table)
    assert all(len(set(row)) == 2 for row in a.table.tolist())
    skewed = MoeModel(msgspec.structs.replace(SPEC, gating_skew=1.5), 512)
    counts = np.bincount(skewed.table.ravel(), minlength=8)
    flat = np.bincount(a.table.ravel(), minlength=8)
    assert counts[0] > 2 * counts[-1]                      # expert 0 is popular
    assert counts.max() / counts.mean() > flat.max() / flat.mean()


def test_step_waits_for_the_slowest_ep_rank():
    m = MoeModel(SPEC, 512)
    # tokens whose experts all live on EP rank 0 (experts 0, 1) vs tokens spread evenly
    hot = [t for t in range(512) if set(m.experts_of(t)) == {0, 1}]
    assert hot, "some token routes to experts 0 and 1"
    st = MoeStats()
    cost = m.step([np.array(hot[:1] * 40)], [st])
    assert cost.per_rank == [80, 0, 0, 0]
    assert cost.moe_ms == pytest.approx(1.0 + 80 * 0.5)    # dispatch + the slowest rank
    assert cost.imbalance == pytest.approx(4.0) and cost.wait_ms == pytest.approx((80 - 20) * 0.5)
    assert list(st.tokens_per_ep_rank) == [80, 0, 0, 0] and int(st.experts.sum()) == 2
    spread = [t for t in range(512) if len({int(m.rank_of[e]) for e in m.experts_of(t)}) == 2]
    per_rank = {}
    for t in spread:  # pick one token per pair of EP ranks so the load is even
        key = tuple(sorted({int(m.rank_of[e]) for e in m.experts_of(t)}))
        per_rank.setdefault(key, t)
    even = m.step([np.array(list(per_rank.values()))], [MoeStats()])
    assert even.imbalance == pytest.approx(1.0) and even.wait_ms == 0
    with pytest.raises(ConfigError):
        MoeSpec(experts=10, top_k=2, ep_ranks=4, expert_ms_per_token=1.0)


def _rank(group: LockstepGroup, rank: int):
    prof = get_profile("cpu-tiny")
    sched = Scheduler(BlockPool(256, 16, events=False), 8, 2048, hash_seed=rank + 1)
    return group.member(rank, sched, prof, 1.0, None)


def test_lockstep_ranks_step_together_and_idle_ranks_wait_for_the_busiest():
    prof = get_profile("cpu-tiny")
    group = LockstepGroup(prof, 1.0, None)
    busy, idle = _rank(group, 0), _rank(group, 1)
    big = Request("big", list(range(1000)), [1, 2], busy.scheduler.prompt_keys(list(range(1000))))
    small = Request("small", list(range(100)), [1, 2], idle.scheduler.prompt_keys(list(range(100))))
    busy.scheduler.add(big)
    idle.scheduler.add(small)
    batches = [busy.schedule_step(), idle.schedule_step()]
    ms = group.cost(batches)
    assert ms == pytest.approx(prof.step_ms(1000, 0))          # the step lasts as long as the busiest rank
    assert group.stats["small"].dp_wait_ms == pytest.approx(prof.step_ms(1000, 0) - prof.step_ms(100, 0))
    assert group.stats["big"].dp_wait_ms == 0


def test_moe_dispatch_span_on_a_data_parallel_replica(exporter):
    exporter.clear()

    async def main():
        args = parser().parse_args(["--time-scale", "0.02", "--no-kv-events", "--profile", "cpu-tiny-moe",
                                    "--data-parallel-size", "2"])
        reps, _ = build_replicas(args)
        for r in reps:
            await r.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(reps[1].url + "/v1/completions",
                                  json={"prompt": "the quick brown fox jumps " * 30, "max_tokens": 3}) as resp:
                    body = await resp.json()
                    assert resp.status == 200 and resp.headers[names.HEADER_REPLICA] == "sim-dp1"
            return body
        finally:
            for r in reps:
                await r.stop()

    body = asyncio.run(main())
    spans = {span_role(s): s for s in exporter.get_finished_spans()}
    req, moe = spans[names.SPAN_ENGINE_REQUEST], spans[names.SPAN_ENGINE_MOE_DISPATCH]
    assert moe.parent.span_id == req.context.span_id
    assert req.attributes[names.DP_RANK] == 1 and moe.attributes[names.DP_RANK] == 1
    a = moe.attributes
    spec = get_profile("cpu-tiny-moe").moe
    computed = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
    assert sum(a[names.MOE_TOKENS_PER_EP_RANK]) == computed * spec.top_k   # every token to top-k experts
    assert len(a[names.MOE_TOKENS_PER_EP_RANK]) == spec.ep_ranks
    assert 1 <= a[names.MOE_EXPERTS_HIT] <= spec.experts
    assert a[names.MOE_IMBALANCE] >= 1.0 and a[names.MOE_WAIT_MS] >= 0 and a[names.MOE_STEPS] >= 3
