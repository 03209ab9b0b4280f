"""vllm-router's `cache_aware` as a picker (gateway/scheduler/cache_aware.py): the balance check,
the match threshold and the least-loaded fallback, as vllm-router 0.1.17 decides."""

from __future__ import annotations

import random

from kvlab.gateway.config import load_policy
from kvlab.gateway.endpoints import Backend, Endpoint
from kvlab.gateway.scheduler import presets
from kvlab.gateway.scheduler.base import RouteRequest


def choose(prefix: dict[str, int], inflight: dict[str, int], prompt: int = 1000) -> str:
    ranker = presets.build(load_policy("vllm-router-cache-aware"), random.Random(0))
    replicas = [Backend(Endpoint(name=n, url=f"http://{n}"), inflight=inflight.get(n, 0)) for n in ("a", "b", "c")]
    return ranker.schedule(RouteRequest(prompt), replicas, prefix).chosen.name


def test_the_preset_carries_vllm_routers_defaults():
    cfg = load_policy("vllm-router-cache-aware")
    assert (cfg.picker, cfg.index.kind) == ("cache-aware", "approximate")
    assert (cfg.cache_aware.cache_threshold, cfg.cache_aware.balance_abs_threshold,
            cfg.cache_aware.balance_rel_threshold) == (0.3, 64, 1.5)


def test_a_match_above_the_threshold_goes_to_its_holder_despite_load():
    assert choose({"c": 400}, {"a": 0, "b": 0, "c": 60}) == "c"       # 0.4 > 0.3; 60 - 0 is not > 64


def test_a_match_at_or_below_the_threshold_goes_to_the_least_loaded_first_in_order():
    assert choose({"c": 300}, {"a": 2, "b": 1, "c": 0}) == "c"
    assert choose({"c": 300}, {"a": 2, "b": 0, "c": 0}) == "b"        # 0.3 is not > 0.3: load, first on a tie
    assert choose({}, {"a": 0, "b": 0, "c": 0}) == "a"


def test_imbalanced_load_overrides_the_tree():
    # 70 - 0 > 64 and 70 > 0 x 1.5: the least loaded, whatever the match
    assert choose({"c": 900}, {"a": 3, "b": 0, "c": 70}) == "b"
    # 100 - 40 is not > 64: balanced, the holder
    assert choose({"c": 900}, {"a": 40, "b": 50, "c": 100}) == "c"
