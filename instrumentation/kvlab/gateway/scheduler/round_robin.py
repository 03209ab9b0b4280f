"""Cache-blind round robin over the candidates by name: the baseline every lab starts from."""

from __future__ import annotations

import itertools
import random

from kvlab.gateway.scheduler.base import Candidate, Picker
from kvlab.gateway.scheduler.registry import plugin


@plugin
class RoundRobin(Picker):
    name = "round-robin"
    shadow = True

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._n = itertools.count()

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        ordered = sorted(candidates, key=lambda c: c.name)
        k = next(self._n) % len(ordered)
        return ordered[k:] + ordered[:k]
