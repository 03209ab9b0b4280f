"""Scheduler plug-ins by name (gateway/scheduler/registry.py): every name a policy file can say has
exactly one plug-in, and every plug-in has its place in the policy schema."""

from __future__ import annotations

import typing

import msgspec
import pytest

from kvlab.gateway.config import PolicyConfig, Weights
from kvlab.gateway.scheduler import presets, registry
from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer
from kvlab.gateway.scheduler.epp import UPSTREAM


def test_every_scorer_has_a_weight_field_and_every_weight_a_scorer():
    assert set(registry.SCORERS) - UPSTREAM == set(Weights.__struct_fields__)


def test_every_picker_a_policy_may_name_is_registered():
    names = set(typing.get_args(typing.get_type_hints(PolicyConfig)["picker"]))
    assert names == set(registry.PICKERS) - UPSTREAM


def test_a_policy_is_assembled_by_name_with_its_weights():
    cfg = msgspec.convert({"name": "t", "picker": "round-robin", "weights": {"prefix": 3, "queue": 1}}, PolicyConfig)
    ranker = presets.build(cfg)
    assert ranker.picker.name == "round-robin" and [f.name for f in ranker.filters] == ["thresholds"]
    assert ranker.weights == {**dict.fromkeys(set(registry.SCORERS) - UPSTREAM, 0.0), "prefix": 3.0, "queue": 1.0}
    assert list(ranker.weights) == [n for n in registry.SCORERS if n not in UPSTREAM]   # the schedule span's order


def test_a_second_plugin_with_a_taken_name_is_refused():
    class Again(Scorer):
        name = "prefix"

        def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
            return [0.0 for _ in candidates]

    with pytest.raises(ValueError, match="two scheduler plug-ins are named 'prefix'"):
        registry.plugin(Again)
    assert registry.SCORERS["prefix"] is not Again


def test_an_unknown_picker_is_a_clear_error():
    with pytest.raises(ValueError, match="no picker named 'nope'; known: cache-aware, max-score, max-score-picker, random, random-picker, rank-blind, round-robin"):
        registry.named(registry.PICKERS, "picker")("nope")
