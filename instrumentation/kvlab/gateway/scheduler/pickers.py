"""Choice rules: the max total score (random tie-break), or cache-blind round robin / random."""

from __future__ import annotations

import itertools
import random

from kvlab.gateway.scheduler.base import Candidate, Picker


class MaxScore(Picker):
    name = "max-score"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        # a random key under equal totals spreads ties instead of always favouring the first
        keyed = [(-round(c.total, 9), self.rng.random(), i) for i, c in enumerate(candidates)]
        return [candidates[i] for _, _, i in sorted(keyed)]


class RoundRobin(Picker):
    name = "round-robin"
    shadow = True

    def __init__(self) -> None:
        self._n = itertools.count()

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        ordered = sorted(candidates, key=lambda c: c.name)
        k = next(self._n) % len(ordered)
        return ordered[k:] + ordered[:k]


class Random(Picker):
    name = "random"
    shadow = True

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        out = list(candidates)
        self.rng.shuffle(out)
        return out


def make(name: str, rng: random.Random | None = None) -> Picker:
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return Random(rng)
    if name == "rank-blind":
        from kvlab.gateway.scheduler.rank_blind import RankBlind
        return RankBlind(rng)
    return MaxScore(rng)
