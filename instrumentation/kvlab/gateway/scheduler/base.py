"""The scheduling pipeline and its data: candidates, scorers, the decision.

filters drop replicas over a load threshold (unless that would drop all of them); every scorer
maps each candidate to [0, 1]; the total is the weighted sum; the picker chooses. Cache-blind
pickers (round robin, random) still get every score, so the decision shows what a KV-aware
choice would have been ("shadow scoring").
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from kvlab.gateway.config import PolicyConfig, Thresholds
from kvlab.gateway.endpoints import Replica


@dataclass(slots=True)
class Candidate:
    replica: Replica
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

    @property
    def predicted_tokens(self) -> int:
        return self.chosen.prefix_tokens

    @property
    def speculative_tokens(self) -> int:
        return self.chosen.speculative_tokens


class Scorer(abc.ABC):
    """Maps each candidate to a score in [0, 1]; higher is better."""

    name: str

    @abc.abstractmethod
    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]: ...


class Picker(abc.ABC):
    name: str
    shadow: bool = False

    @abc.abstractmethod
    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        """All candidates in the order to try; the first is the choice."""


def apply_thresholds(cands: list[Candidate], t: Thresholds) -> tuple[list[Candidate], list[str]]:
    def over(c: Candidate) -> bool:
        r = c.replica
        return ((t.max_waiting is not None and r.waiting > t.max_waiting)
                or (t.max_kv_usage is not None and r.kv_usage > t.max_kv_usage)
                or (t.max_inflight is not None and r.inflight > t.max_inflight))
    kept = [c for c in cands if not over(c)]
    if not kept:   # everyone is overloaded: filtering would only refuse work
        return cands, []
    return kept, [c.name for c in cands if over(c)]


def normalised_inverse(values: list[float]) -> list[float]:
    """1 - v / max(v): the least loaded gets 1, the most loaded 0; all equal (or all 0) -> 1."""
    top = max(values, default=0.0)
    if top <= 0:
        return [1.0] * len(values)
    return [1.0 - v / top for v in values]


class Scheduler:
    def __init__(self, cfg: PolicyConfig, scorers: list[Scorer], picker: Picker) -> None:
        self.cfg = cfg
        self.picker = picker
        weights = {"prefix": cfg.weights.prefix, "queue": cfg.weights.queue,
                   "kv_usage": cfg.weights.kv_usage, "inflight": cfg.weights.inflight,
                   "inflight_tokens": cfg.weights.inflight_tokens,
                   "pending_prefill": cfg.weights.pending_prefill, "predicted_ttft": cfg.weights.predicted_ttft}
        self.scorers = [(s, weights[s.name]) for s in scorers]
        self.weights = {s.name: w for s, w in self.scorers}

    def schedule(self, req: RouteRequest, replicas: list[Replica], prefix: dict[str, int],
                 speculative: dict[str, int] | None = None, cpu: dict[str, int] | None = None) -> Decision:
        """Pick among `replicas` (non-empty, already healthy); `prefix` maps name -> cached tokens,
        `speculative` name -> how many of them are not yet confirmed."""
        spec = speculative or {}
        offloaded = cpu or {}
        cands = [Candidate(r, prefix.get(r.name, 0), spec.get(r.name, 0), offloaded.get(r.name, 0)) for r in replicas]
        available = max((c.prefix_tokens for c in cands), default=0)
        kept, filtered = apply_thresholds(cands, self.cfg.thresholds)
        for scorer, w in self.scorers:
            for c, s in zip(kept, scorer.score(req, kept)):
                c.scores[scorer.name] = s
                c.total += w * s
        ranked = self.picker.pick(kept)
        # refused connections fall back over the filtered-out replicas too, last
        ranked += [c for c in cands if c.name in filtered]
        chosen = ranked[0]
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
        return Decision(chosen, ranked, cands, available, reason, self.picker.shadow, best, filtered)
