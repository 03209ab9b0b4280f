"""Scorers, picker and policy presets."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from kvlab.contract import Endpoint
from kvlab.errors import ConfigError
from kvlab.gateway.config import PRESETS, load_policy, preset_path
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.scheduler import presets
from kvlab.gateway.scheduler.base import Candidate, RouteRequest
from kvlab.gateway.scheduler.inflight import InflightScorer
from kvlab.gateway.scheduler.kv_usage import KvUsageScorer
from kvlab.gateway.scheduler.max_score import MaxScore
from kvlab.gateway.scheduler.prefix import PrefixScorer
from kvlab.gateway.scheduler.queue import QueueScorer


def rep(name, waiting=0, inflight=0, kv=0.0):
    return Backend(Endpoint(name=name, url=f"http://{name}"), waiting=waiting, inflight=inflight, kv_usage=kv)


def test_every_shipped_preset_validates():
    for name in PRESETS:
        assert preset_path(name).is_file()
        cfg = load_policy(name)
        assert cfg.name == name
    assert {p.stem for p in preset_path("kv-aware").parent.glob("*.yaml")} == set(PRESETS)


def test_config_file_merges_over_preset_and_rejects_typos(tmp_path: Path):
    f = tmp_path / "p.yaml"
    f.write_text("preset: kv-aware\nweights: {queue: 2.5}\n")
    cfg = load_policy(None, f)
    assert cfg.weights.queue == 2.5 and cfg.weights.prefix == load_policy("kv-aware").weights.prefix
    f.write_text("weights: {prefx: 1}\n")
    with pytest.raises(ConfigError, match="prefx"):
        load_policy("kv-aware", f)
    with pytest.raises(ConfigError, match="unknown policy"):
        load_policy("fastest")


def test_scorers():
    req = RouteRequest(prompt_tokens=100)
    cands = [Candidate(rep("a", waiting=4, inflight=2, kv=0.9), prefix_tokens=80),
             Candidate(rep("b", waiting=0, inflight=0, kv=0.2), prefix_tokens=0),
             Candidate(rep("c", waiting=2, inflight=1, kv=0.5), prefix_tokens=200)]
    assert PrefixScorer().score(req, cands) == [0.8, 0.0, 1.0]
    assert QueueScorer().score(req, cands) == [0.0, 1.0, 0.5]
    assert InflightScorer().score(req, cands) == [0.0, 1.0, 0.5]
    assert KvUsageScorer().score(req, cands) == pytest.approx([0.1, 0.8, 0.5])
    idle = [Candidate(rep("x")), Candidate(rep("y"))]
    assert QueueScorer().score(req, idle) == [1.0, 1.0]


def test_picker_max_score_random_tie_break():
    picker = MaxScore(random.Random(0))
    a, b, c = Candidate(rep("a"), total=1.0), Candidate(rep("b"), total=2.0), Candidate(rep("c"), total=2.0)
    firsts = Counter(picker.pick([a, b, c])[0].name for _ in range(200))
    assert set(firsts) == {"b", "c"} and min(firsts.values()) > 60
    assert picker.pick([a, b, c])[-1].name == "a"


def test_kv_aware_prefers_prefix_unless_overloaded():
    sched = presets.build(load_policy("kv-aware"), random.Random(0))
    reps = [rep("a", waiting=1), rep("b"), rep("c")]
    d = sched.schedule(RouteRequest(1000), reps, {"a": 900, "b": 0, "c": 0})
    assert d.chosen.name == "a" and d.reason == "prefix" and d.available_tokens == 900 and d.predicted_tokens == 900
    # over the max_waiting threshold: filtered, load decides, the lost prefix shows in the reason
    reps[0].waiting = 100
    d = sched.schedule(RouteRequest(1000), reps, {"a": 900})
    assert d.chosen.name != "a" and d.reason == "load-over-prefix" and d.filtered == ["a"]
    assert d.available_tokens == 900 and d.predicted_tokens == 0
    assert d.ranked[-1].name == "a"     # still a last resort for retries
    # nobody holds a prefix: the least loaded wins
    reps = [rep("a", inflight=3), rep("b", inflight=1), rep("c", inflight=2)]
    d = sched.schedule(RouteRequest(1000), reps, {})
    assert d.chosen.name == "b" and d.reason == "load"


def test_round_robin_cycles_and_scores_in_shadow():
    sched = presets.build(load_policy("round-robin"))
    reps = [rep("a"), rep("b"), rep("c")]
    chosen = [sched.schedule(RouteRequest(100), reps, {"c": 100}) for _ in range(6)]
    assert [d.chosen.name for d in chosen] == ["a", "b", "c", "a", "b", "c"]
    assert all(d.shadow and d.best.name == "c" and d.reason == "round-robin" for d in chosen)
    assert [d.predicted_tokens for d in chosen[:3]] == [0, 0, 100]
    assert all(d.available_tokens == 100 for d in chosen)
    assert all(set(d.chosen.scores) == {"prefix", "queue", "kv_usage", "inflight", "inflight_tokens",
                                                "pending_prefill", "predicted_ttft"} for d in chosen)


def test_least_load_ignores_prefix():
    sched = presets.build(load_policy("least-load"), random.Random(0))
    d = sched.schedule(RouteRequest(100), [rep("a", inflight=1), rep("b")], {"a": 100})
    assert d.chosen.name == "b" and d.available_tokens == 100
