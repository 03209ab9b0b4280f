"""Threshold filter: a replica over `thresholds.max_waiting`, `max_kv_usage` or `max_inflight` is
not a candidate (unless every replica is: the ranker then keeps them all)."""

from __future__ import annotations

import random
from typing import Any, Self

from kvlab.config import convert
from kvlab.gateway.config import PolicyConfig, Thresholds
from kvlab.gateway.scheduler.base import Candidate, Filter
from kvlab.gateway.scheduler.registry import plugin


@plugin
class ThresholdFilter(Filter):
    name = "thresholds"

    def __init__(self, t: Thresholds | None = None) -> None:
        self.t = t or Thresholds()

    @classmethod
    def from_policy(cls, cfg: PolicyConfig, rng: random.Random) -> Self:
        return cls(cfg.thresholds)

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        return cls(convert(parameters, Thresholds, f"plugin {cls.name} parameters"))

    def drop(self, candidates: list[Candidate]) -> list[str]:
        t = self.t
        return [c.name for c in candidates
                if (t.max_waiting is not None and c.replica.waiting > t.max_waiting)
                or (t.max_kv_usage is not None and c.replica.kv_usage > t.max_kv_usage)
                or (t.max_inflight is not None and c.replica.inflight > t.max_inflight)]
