"""Wide-EP: data-parallel ranks as endpoints of their own, and DP-aware vs rank-blind routing
(docs/wide-ep.md)."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import zmq
import zmq.asyncio

from kvlab.contract import Endpoint
from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.engine.sim.profile import get_profile
from kvlab.engine.sim.replay import replay, shared_prefix_workload
from kvlab.gateway import dp as dp_view
from kvlab.gateway.config import load_policy
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.scheduler import presets
from kvlab.gateway.scheduler.base import RouteRequest
from kvlab.kvcache.events import BlockStored, decode_batch


def test_ranks_have_their_own_port_events_and_metrics():
    async def main():
        args = parser().parse_args(["--time-scale", "0.02", "--replicas", "2", "--data-parallel-size", "2",
                                    "--name", "wep"])
        reps, ports = build_replicas(args)
        assert len(reps) == 4 and len(ports) == 4
        for r in reps:
            await r.start("127.0.0.1", 0)
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            eps = [r.endpoint() for r in reps]
            assert [(e.name, e.dp_rank, e.replica) for e in eps] == [
                ("wep-0-dp0", 0, "wep-0"), ("wep-0-dp1", 1, "wep-0"), ("wep-1-dp0", 0, "wep-1"), ("wep-1-dp1", 1, "wep-1")]
            assert len({e.url for e in eps}) == 4 and len({e.kv_events for e in eps}) == 4
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(eps[3].kv_events)
            await asyncio.sleep(0.3)  # slow joiner
            async with aiohttp.ClientSession() as s:
                async with s.post(eps[3].url + "/v1/completions", json={"prompt": "one two three " * 20, "max_tokens": 2}) as r:
                    assert r.status == 200
                async with s.get(eps[3].url + "/metrics") as r:
                    text = await r.text()
                async with s.get(eps[2].url + "/metrics") as r:
                    text0 = await r.text()
            assert 'vllm:num_requests_waiting{engine="1"' in text and 'engine="0"' in text0
            _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            batch = decode_batch(payload)
            assert batch.data_parallel_rank == 1 and any(isinstance(e, BlockStored) for e in batch.events)
            # the other ranks of that replica cached nothing: each rank has its own KV cache
            assert reps[2].engine.scheduler.pool.num_cached == 0 and reps[3].engine.scheduler.pool.num_cached > 0
        finally:
            sub.close(0)
            ctx.term()
            for r in reps:
                await r.stop()

    asyncio.run(main())


def _runs(policy: str, seed: int):
    wl = shared_prefix_workload(seed=seed, n=240, groups=24, rate_per_s=25)
    router = presets.build(load_policy(policy), random.Random(seed))
    return replay(wl, router, get_profile("cpu-tiny-moe"), replicas=1, data_parallel_size=4,
                  max_num_seqs=16, num_blocks=1024, seed=seed)


def test_dp_aware_raises_hit_rate_and_lowers_worst_rank_queue_vs_rank_blind():
    for seed in (1, 2):
        aware, blind = _runs("dp-aware", seed), _runs("rank-blind", seed)
        assert aware.hit_rate > blind.hit_rate + 0.1, (aware.hit_rate, blind.hit_rate)
        assert aware.worst_peak_waiting < blind.worst_peak_waiting
        assert aware.worst_mean_waiting < blind.worst_mean_waiting
        assert aware.mean_ttft_ms < blind.mean_ttft_ms
        # rank-blind spreads requests about evenly by count (thresholds aside), and still loses
        counts = [r.requests for r in blind.ranks.values()]
        assert max(counts) - min(counts) <= 0.1 * sum(counts)
    again = _runs("dp-aware", 1)
    assert again.hit_rate == _runs("dp-aware", 1).hit_rate   # same seed, same result


def _rank(name: str, rank: int, replica: str = "r0", **load) -> Backend:
    return Backend(Endpoint(name=name, url=f"http://x/{name}", dp_rank=rank, replica=replica), **load)


def test_rank_reason_and_siblings_explain_the_choice():
    sched = presets.build(load_policy("dp-aware"), random.Random(0))
    ranks = [_rank("r0-dp0", 0), _rank("r0-dp1", 1), _rank("r1-dp0", 0, "r1")]
    d = sched.schedule(RouteRequest(1000), ranks, {"r0-dp1": 800})
    assert d.chosen.name == "r0-dp1" and dp_view.rank_reason(d) == "prefix-on-rank"
    assert [s["name"] for s in dp_view.sibling_view(d)] == ["r0-dp0", "r0-dp1"]
    # the rank with the prefix is swamped: a sibling wins on load
    ranks = [_rank("r0-dp0", 0), _rank("r0-dp1", 1, waiting=40, inflight=20, inflight_tokens=50_000)]
    d = sched.schedule(RouteRequest(1000), ranks, {"r0-dp1": 200})
    assert d.chosen.name == "r0-dp0" and dp_view.rank_reason(d) == "load-over-prefix"
    # in-flight tokens break a tie the request count cannot see
    ranks = [_rank("r0-dp0", 0, inflight=1, inflight_tokens=4000), _rank("r0-dp1", 1, inflight=1, inflight_tokens=100)]
    d = sched.schedule(RouteRequest(1000), ranks, {})
    assert d.chosen.name == "r0-dp1" and dp_view.rank_reason(d) == "least-loaded-rank"


def test_rank_blind_picks_the_replica_by_score_and_rotates_its_ranks():
    sched = presets.build(load_policy("rank-blind"), random.Random(0))
    ranks = [_rank("r0-dp0", 0), _rank("r0-dp1", 1), _rank("r1-dp0", 0, "r1"), _rank("r1-dp1", 1, "r1")]
    chosen = [sched.schedule(RouteRequest(1000), ranks, {"r1-dp1": 900}) for _ in range(4)]
    assert [d.chosen.name for d in chosen] == ["r1-dp0", "r1-dp1", "r1-dp0", "r1-dp1"]
    assert all(d.shadow and d.best.name == "r1-dp1" and dp_view.rank_reason(d) == "rank-blind" for d in chosen)
    json.dumps(dp_view.sibling_view(chosen[0]))
