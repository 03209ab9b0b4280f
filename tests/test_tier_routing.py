"""Tier-aware routing (docs/tiered.md): the router splits each prefix by tier from the index, the
prefix scorer weighs CPU-only tokens (llm-d's 0.8 by default, 0 = tier-blind), and the pull decision
re-routes to an idle holder or leaves a pull hint."""

from __future__ import annotations

import msgspec

from kvlab.contract import Endpoint
from kvlab.gateway.config import load_policy
from kvlab.gateway.endpoints import Registry
from kvlab.gateway.router import Router
from kvlab.gateway.scheduler import presets
from kvlab.kvcache.events import BlockStored
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex

BS = 16
PROMPT = list(range(1, 1 + 40 * BS))          # 40 blocks


def _router(policy: str, **over) -> tuple[Router, Registry, PreciseIndex]:
    cfg = load_policy(policy)
    if over:
        cfg = msgspec.structs.replace(cfg, **over)
    reg = Registry()
    reg.update([Endpoint(name=n, url=f"http://{n}") for n in ("a", "b", "c")])
    for r in reg.replicas.values():
        r.events_state, r.block_size = "live", BS
    precise = PreciseIndex()
    return Router(cfg, reg, precise, ApproximateIndex(), presets.build(cfg)), reg, precise


def _store(precise: PreciseIndex, replica: str, blocks: int, medium: str) -> None:
    precise.apply(replica, [BlockStored(block_hashes=list(range(1000, 1000 + blocks)), parent_block_hash=None,
                                        token_ids=PROMPT[:blocks * BS], block_size=BS, medium=medium)])


def test_tier_aware_prefers_a_long_cpu_prefix_and_the_span_data_splits_it():
    router, _, precise = _router("kv-aware")
    _store(precise, "a", 10, "GPU")               # 10 blocks on GPU
    _store(precise, "b", 36, "CPU")               # 36 blocks, only in CPU memory
    routed = router.route(PROMPT)
    d = routed.decision
    assert d.chosen.name == "b"
    by = {c.name: c for c in d.candidates}
    assert by["b"].prefix_tokens == 36 * BS and by["b"].cpu_tokens == 36 * BS
    assert by["a"].prefix_tokens == 10 * BS and by["a"].cpu_tokens == 0
    assert by["b"].scores["prefix"] == 0.8 * 36 * BS / len(PROMPT)
    assert routed.cpu == {"a": 0, "b": 36 * BS, "c": 0}


def test_tier_blind_policy_ignores_the_cpu_tier():
    router, _, precise = _router("kv-aware-gpu-only")
    _store(precise, "a", 10, "GPU")
    _store(precise, "b", 36, "CPU")
    d = router.route(PROMPT).decision
    assert d.chosen.name == "a"
    assert {c.name: c.prefix_tokens for c in d.candidates} == {"a": 10 * BS, "b": 0, "c": 0}


def test_cpu_weight_trades_off_against_gpu():
    # the prefix scorer's tier weights alone: kv-aware's predicted_ttft counts CPU-held tokens as
    # cached (no load cost), so with it b's longer CPU prefix would win on predicted time instead
    cfg = load_policy("kv-aware")
    router, _, precise = _router("kv-aware", weights=msgspec.structs.replace(cfg.weights, predicted_ttft=0.0))
    _store(precise, "a", 30, "GPU")               # 30 x 1.0 > 36 x 0.8
    _store(precise, "b", 36, "CPU")
    assert router.route(PROMPT).decision.chosen.name == "a"


def test_pull_reroutes_to_an_idle_holder_or_hints_a_pull_from_a_busy_one():
    router, reg, precise = _router("kv-aware-pull")
    _store(precise, "a", 39, "GPU")
    a, b = reg.replicas["a"], reg.replicas["b"]
    a.waiting = 40                                # over max_waiting: the scheduler passes a over
    a.pending_prefill_tokens = 20_000             # and its queue is long: a pull beats waiting
    routed = router.route(PROMPT)
    assert routed.decision.chosen.name != "a"
    p = routed.pull
    assert p is not None and p.choice == "pull" and p.holder == "a" and p.target == routed.decision.chosen.name
    assert p.costs["pull"] < p.costs["recompute"] < p.costs["holder"]
    a.pending_prefill_tokens = 0                  # the same holder, idle: go there after all
    b.pending_prefill_tokens = 5_000
    reg.replicas["c"].pending_prefill_tokens = 5_000
    routed = router.route(PROMPT)
    assert routed.pull is not None and routed.pull.choice == "holder"
    assert routed.decision.chosen.name == "a" and routed.decision.ranked[0].name == "a"
