"""Load that counts work: the per-replica pending-prefill book (released at the first token, cost
per token learned from TTFTs) and the pending-prefill and predicted-TTFT scorers."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvlab.contract import Endpoint
from kvlab.gateway.config import Weights, load_policy
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.prefill import PrefillBook
from kvlab.gateway.scheduler import presets
from kvlab.gateway.scheduler.base import Candidate, RouteRequest
from kvlab.gateway.scheduler.pending_prefill import PendingPrefillScorer
from kvlab.gateway.scheduler.predicted_ttft import PredictedTtftScorer, predicted_ttft_ms


def rep(name: str, pending: int = 0, cost: float | None = None, inflight: int = 0) -> Backend:
    return Backend(Endpoint(name=name, url=f"http://{name}"), pending_prefill_tokens=pending,
                   prefill_ms_per_token=cost, inflight=inflight)


def test_book_counts_uncached_work_until_the_first_token_and_learns_the_cost():
    book = PrefillBook(alpha=0.5, min_tokens=64)
    r = rep("a")
    p1 = book.start(r, 1000)
    p2 = book.start(r, 500)
    assert r.pending_prefill_tokens == 1500 and (p1.ahead, p2.ahead) == (0, 1000)
    book.first_token(p1, now=p1.started + 1.0)           # 1,000 tokens in 1 s: 1 ms/token
    assert r.pending_prefill_tokens == 500 and r.prefill_ms_per_token == pytest.approx(1.0)
    book.first_token(p2, now=p2.started + 4.5)           # 1,000 ahead + 500 own in 4.5 s: 3 ms/token
    assert r.pending_prefill_tokens == 0 and r.prefill_ms_per_token == pytest.approx(2.0)   # EWMA, alpha 0.5
    book.finish(p2)                                      # already released: nothing happens twice
    assert r.pending_prefill_tokens == 0
    p3 = book.start(r, 700)
    book.finish(p3)                                      # failed before a first token: released, no sample
    assert r.pending_prefill_tokens == 0 and r.prefill_ms_per_token == pytest.approx(2.0)
    p4 = book.start(r, 10)                               # a tiny prefill is mostly overhead: no sample
    book.first_token(p4, now=p4.started + 1.0)
    assert r.prefill_ms_per_token == pytest.approx(2.0)


def test_pending_prefill_scorer_weighs_tokens_not_requests():
    req = RouteRequest(prompt_tokens=100)
    busy = Candidate(rep("long-miss", pending=4000, inflight=1))
    chatty = Candidate(rep("five-hits", pending=250, inflight=5))
    assert PendingPrefillScorer().score(req, [busy, chatty]) == pytest.approx([0.0, 1 - 250 / 4000])


def test_predicted_ttft_combines_cost_queue_and_cache():
    req = RouteRequest(prompt_tokens=2000)
    cands = [Candidate(rep("warm-busy", pending=3000, cost=1.0), prefix_tokens=1900),   # 1.0 x 3,100
             Candidate(rep("cold-idle", pending=0, cost=1.0), prefix_tokens=0),         # 1.0 x 2,000
             Candidate(rep("warm-slow", pending=0, cost=20.0), prefix_tokens=1900),     # 20 x 100
             Candidate(rep("unknown", pending=500), prefix_tokens=1500)]                # mean cost 7.33 x 1,000
    assert predicted_ttft_ms(req, cands) == pytest.approx([3100.0, 2000.0, 2000.0, 22000 / 3])
    scores = PredictedTtftScorer().score(req, cands)
    assert scores[1] == scores[2] > scores[0] > scores[3] == 0.0
    # no replica has a sample yet: ranks by tokens alone
    fresh = [Candidate(rep("x", pending=100)), Candidate(rep("y"), prefix_tokens=1000)]
    assert predicted_ttft_ms(req, fresh) == [2100.0, 1000.0]


def test_weights_reach_the_schedule():
    cfg = msgspec.structs.replace(load_policy("kv-aware"), weights=Weights(prefix=1.0, predicted_ttft=5.0))
    sched = presets.build(cfg, random.Random(0))
    reps = [rep("warm-busy", pending=3000, cost=1.0), rep("cold-idle", cost=1.0)]
    d = sched.schedule(RouteRequest(2000), reps, {"warm-busy": 1900})
    assert d.chosen.name == "cold-idle" and d.reason == "load-over-prefix"
    assert sched.weights["predicted_ttft"] == 5.0 and sched.weights["pending_prefill"] == 0.0
