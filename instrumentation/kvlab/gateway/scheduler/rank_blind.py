"""The rank-blind picker: data-parallel ranks of one replica are interchangeable.

It is what a router sees when a wide-EP replica is one address and the engine spreads requests
over its ranks itself, or when ranks sit behind one Service: the replica is chosen by its best
rank's score (the router knows the replica holds the prefix and how loaded it is), then the rank
is taken round robin inside that replica, blind to which rank holds the cache or a queue.
Endpoints without a replica (dp_rank None) are replicas of their own. The comparison preset for
DP-aware routing (docs/wide-ep.md); scores stay on the span, so the shadow choice shows the rank
a DP-aware router would have taken.
"""

from __future__ import annotations

import random
from collections import defaultdict

from kvlab.gateway.scheduler.base import Candidate, Picker
from kvlab.gateway.scheduler.registry import plugin


def replica_of(c: Candidate) -> str:
    e = c.replica.endpoint
    return e.replica or e.name


@plugin
class RankBlind(Picker):
    name = "rank-blind"
    shadow = True   # the scores chose the replica but not the rank

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._turn: dict[str, int] = defaultdict(int)

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        groups: dict[str, list[Candidate]] = defaultdict(list)
        for c in candidates:
            groups[replica_of(c)].append(c)
        order = sorted(groups, key=lambda r: (-round(max(c.total for c in groups[r]), 9), self.rng.random()))
        out: list[Candidate] = []
        for rep in order:
            ranks = sorted(groups[rep], key=lambda c: c.name)
            k = self._turn[rep] % len(ranks)
            self._turn[rep] += 1
            out += ranks[k:] + ranks[:k]
        return out
