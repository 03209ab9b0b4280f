"""Cache-blind random choice: the control where routing cannot matter."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, Picker
from kvlab.gateway.scheduler.registry import plugin


@plugin
class RandomChoice(Picker):
    name = "random"
    shadow = True

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        out = list(candidates)
        self.rng.shuffle(out)
        return out
