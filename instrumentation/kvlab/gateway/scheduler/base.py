"""The scheduling pipeline and its data: candidates, the plug-in interfaces, the decision.

Filters drop candidates (a replica over a load threshold, unless that would drop all of them);
every scorer maps each candidate to [0, 1]; the total is the weighted sum; the picker chooses.
Cache-blind pickers (round robin, random) still get every score, so the decision shows what a
KV-aware choice would have been ("shadow scoring"). Plug-ins are registered by name (registry.py).
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from kvlab.errors import ConfigError
from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.endpoints import Backend


@dataclass(slots=True)
class Candidate:
    replica: Backend
    prefix_tokens: int = 0
    speculative_tokens: int = 0      # the part of prefix_tokens not yet confirmed by the engine
    cpu_tokens: int = 0              # the part of prefix_tokens held only in the CPU tier (docs/tiered.md)
    scores: dict[str, float] = field(default_factory=dict)
    total: float = 0.0

    @property
    def name(self) -> str:
        return self.replica.name


@dataclass(slots=True)
class RouteRequest:
    prompt_tokens: int
    tokens: Sequence[int] = ()       # the prompt itself, for a scorer with its own index (prefix_cache.py)


@dataclass(slots=True)
class Phases:
    """When each step of one scheduling ran (Unix ns): the spans llm-d's scheduler opens around
    them (filter_endpoints, llm_d.epp.scoring with one child per scorer, pick_endpoints) are
    written from these after the fact, so an untraced request pays a few clock reads only."""

    filter_start: int
    scoring_start: int
    scorers: list[tuple[int, int]]   # (start, end) of each of the ranker's scorers, in order
    pick_start: int
    end: int


@dataclass(slots=True)
class Decision:
    chosen: Candidate
    ranked: list[Candidate]          # the order to try on a refused connection (chosen first)
    candidates: list[Candidate]      # every scored candidate
    available_tokens: int            # best cached prefix over all healthy replicas
    reason: str
    shadow: bool                     # scores were computed but did not decide
    best: Candidate                  # the max-score candidate (== chosen unless shadow)
    filtered: list[str] = field(default_factory=list)
    phases: Phases | None = None

    @property
    def predicted_tokens(self) -> int:
        return self.chosen.prefix_tokens

    @property
    def speculative_tokens(self) -> int:
        return self.chosen.speculative_tokens


class Plugin(abc.ABC):
    """A filter, scorer or picker: `name` is what a policy file calls it (registry.py)."""

    name: str

    @classmethod
    def from_policy(cls, cfg: PolicyConfig, rng: random.Random) -> Self:
        """The plug-in configured for a policy (override to read its settings)."""
        return cls()

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        """The plug-in from an EndpointPickerConfig entry's `parameters` (scheduler/epp.py);
        override to read them (the default takes none)."""
        if parameters:
            raise ConfigError(f"plugin {cls.name!r} takes no parameters (got {', '.join(parameters)})")
        return cls()


class Filter(Plugin):
    """Drops candidates that should not be chosen now."""

    @abc.abstractmethod
    def drop(self, candidates: list[Candidate]) -> list[str]:
        """Names of the candidates to drop."""


class Scorer(Plugin):
    """Maps each candidate to a score in [0, 1]; higher is better. `index_kind`: the gateway index
    its candidates' `prefix_tokens` must come from (an EndpointPickerConfig's policy follows it)."""

    index_kind: str | None = None

    @abc.abstractmethod
    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]: ...

    def chosen(self, req: RouteRequest, chosen: Candidate) -> None:
        """Told the decision (GIE's PreRequest): a scorer that learns from routing learns here."""


class Picker(Plugin):
    """Orders the candidates to try; `rng` breaks ties (seeded in tests and replays)."""

    shadow: bool = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    @classmethod
    def from_policy(cls, cfg: PolicyConfig, rng: random.Random) -> Self:
        return cls(rng)

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        if parameters:
            raise ConfigError(f"plugin {cls.name!r} takes no parameters (got {', '.join(parameters)})")
        return cls(rng)

    @abc.abstractmethod
    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        """All candidates in the order to try; the first is the choice."""


def normalised_inverse(values: list[float]) -> list[float]:
    """1 - v / max(v): the least loaded gets 1, the most loaded 0; all equal (or all 0) -> 1."""
    top = max(values, default=0.0)
    if top <= 0:
        return [1.0] * len(values)
    return [1.0 - v / top for v in values]


class Ranker:
    def __init__(self, filters: list[Filter], scorers: list[tuple[Scorer, float]], picker: Picker) -> None:
        self.filters = filters
        self.picker = picker
        self.scorers = scorers
        self.weights = {s.name: w for s, w in scorers}

    def _filter(self, cands: list[Candidate]) -> tuple[list[Candidate], list[str]]:
        dropped = {name for f in self.filters for name in f.drop(cands)}
        kept = [c for c in cands if c.name not in dropped]
        if not kept:   # everyone is overloaded: filtering would only refuse work
            return cands, []
        return kept, [c.name for c in cands if c.name in dropped]

    def schedule(self, req: RouteRequest, replicas: list[Backend], prefix: dict[str, int],
                 speculative: dict[str, int] | None = None, cpu: dict[str, int] | None = None) -> Decision:
        """Pick among `replicas` (non-empty, already healthy); `prefix` maps name -> cached tokens,
        `speculative` name -> how many of them are not yet confirmed."""
        spec = speculative or {}
        offloaded = cpu or {}
        cands = [Candidate(r, prefix.get(r.name, 0), spec.get(r.name, 0), offloaded.get(r.name, 0)) for r in replicas]
        available = max((c.prefix_tokens for c in cands), default=0)
        clock = time.time_ns
        t_filter = clock()
        kept, filtered = self._filter(cands)
        t_scoring = t = clock()
        spans = []
        for scorer, w in self.scorers:
            for c, s in zip(kept, scorer.score(req, kept)):
                c.scores[scorer.name] = s
                c.total += w * s
            spans.append((t, t := clock()))
        ranked = self.picker.pick(kept)
        phases = Phases(t_filter, t_scoring, spans, t, clock())
        # refused connections fall back over the filtered-out replicas too, last
        ranked += [c for c in cands if c.name in filtered]
        chosen = ranked[0]
        for scorer, _ in self.scorers:
            scorer.chosen(req, chosen)
        best = max(kept, key=lambda c: c.total)
        if self.picker.shadow:
            reason = self.picker.name
        elif len(kept) == 1:
            reason = "single-candidate"
        elif available == 0:
            reason = "load"                 # nobody holds a prefix: load decided
        elif chosen.prefix_tokens >= available:
            reason = "prefix"               # chosen holds the best prefix
        else:
            reason = "load-over-prefix"     # a longer prefix existed but its load outweighed it
        return Decision(chosen, ranked, cands, available, reason, self.picker.shadow, best, filtered, phases)
