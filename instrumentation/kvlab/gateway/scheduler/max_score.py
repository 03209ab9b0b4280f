"""The KV-aware choice: the max total score, ties broken at random (always favouring the first
would pile ties onto one replica)."""

from __future__ import annotations

from kvlab.gateway.scheduler.base import Candidate, Picker
from kvlab.gateway.scheduler.registry import plugin


@plugin
class MaxScore(Picker):
    name = "max-score"

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        keyed = [(-round(c.total, 9), self.rng.random(), i) for i, c in enumerate(candidates)]
        return [candidates[i] for _, _, i in sorted(keyed)]
