"""Prefix scorer: the share of the prompt already cached on the replica (precise or approximate
index, looked up before scheduling). 1.0 = the whole prompt would be a cache hit on GPU. Tokens held
only in a replica's CPU tier count `cpu` (they are loaded, not recomputed: docs/tiered.md)."""

from __future__ import annotations

import random
from typing import Any, Literal, Self

from kvlab.config import Strict, convert
from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.scheduler.base import Candidate, RouteRequest, Scorer
from kvlab.gateway.scheduler.registry import plugin


class PrefixParams(Strict, frozen=True):
    """Its EndpointPickerConfig parameters: the index (a policy's `index.kind`) and tier weights."""

    index: Literal["precise", "approximate"] = "precise"
    gpu: float = 1.0
    cpu: float = 0.8


@plugin
class PrefixScorer(Scorer):
    name = "prefix"

    def __init__(self, gpu: float = 1.0, cpu: float = 0.8) -> None:
        self.gpu = gpu
        self.cpu = cpu

    @classmethod
    def from_policy(cls, cfg: PolicyConfig, rng: random.Random) -> Self:
        return cls(cfg.index.tiers.gpu, cfg.index.tiers.cpu)

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        p = convert(parameters, PrefixParams, f"plugin {cls.name} parameters")
        out = cls(p.gpu, p.cpu)
        out.index_kind = p.index
        return out

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        n = max(req.prompt_tokens, 1)
        return [min((self.gpu * (c.prefix_tokens - c.cpu_tokens) + self.cpu * c.cpu_tokens) / n, 1.0)
                for c in candidates]
