"""A mixture-of-experts layer in the step-time model: deterministic gating and the EP cost.

Each token computed in a step is sent to `top_k` of `experts` experts. The choice is a fixed
function of the token id (a seeded Gumbel top-k over expert popularities, so the same prompt hits
the same experts on every replica and every run); `gating_skew` makes some experts popular
(Zipf exponent, 0 = uniform). Experts are placed contiguously over `ep_ranks` expert-parallel
ranks (expert e lives on rank e // (experts / ep_ranks), vLLM's linear placement without EPLB).

The MoE part of a step waits for the slowest EP rank:

    moe_ms = dispatch_ms + max_j(T_j) * expert_ms_per_token

where T_j is the number of (token, expert) assignments that land on EP rank j, summed over every
data-parallel rank stepping together. A perfectly balanced step would take mean_j(T_j) instead of
max_j(T_j); the difference is the time spent waiting for the slowest rank, and
imbalance = max_j(T_j) / mean_j(T_j) (1.0 = perfect). docs/wide-ep.md explains how to read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlab.config import Strict
from kvlab.errors import ConfigError


class MoeSpec(Strict, frozen=True):
    """The MoE part of a latency profile (profiles.yaml, key `moe`)."""

    experts: int                     # routed experts per MoE layer (E)
    top_k: int                       # experts each token is sent to
    ep_ranks: int                    # expert-parallel ranks the experts are spread over
    expert_ms_per_token: float       # an EP rank's time per (token, expert) assignment it receives
    dispatch_ms: float = 0.0         # all-to-all dispatch + combine, once per step
    gating_skew: float = 0.0         # Zipf exponent of expert popularity (0 = uniform)
    gating_seed: int = 0

    def __post_init__(self) -> None:
        if min(self.experts, self.top_k, self.ep_ranks) < 1 or self.top_k > self.experts:
            raise ConfigError("moe: need 1 <= top_k <= experts and ep_ranks >= 1")
        if self.experts % self.ep_ranks:
            raise ConfigError(f"moe: {self.experts} experts do not split evenly over {self.ep_ranks} EP ranks")


@dataclass(slots=True)
class MoeStats:
    """What one request saw of the MoE layers, accumulated over the steps it took part in."""

    steps: int = 0
    experts: np.ndarray | None = None          # bool [E]: experts its tokens were sent to
    tokens_per_ep_rank: np.ndarray | None = None  # int [ep]: its (token, expert) assignments per EP rank
    imbalance_sum: float = 0.0                 # sum over its steps of the step's imbalance
    wait_ms: float = 0.0                       # its steps' time waiting for the slowest EP rank (scaled)
    dp_wait_ms: float = 0.0                    # its steps' time waiting for the busiest DP rank (scaled)


@dataclass(slots=True)
class StepCost:
    moe_ms: float                    # unscaled MoE time of the step
    wait_ms: float                   # unscaled: max - mean EP-rank time
    imbalance: float                 # max / mean tokens per EP rank
    per_rank: list[int] = field(default_factory=list)


class MoeModel:
    """Gating table + EP placement of one MoE spec, for a vocabulary of `vocab_size` tokens."""

    def __init__(self, spec: MoeSpec, vocab_size: int) -> None:
        self.spec = spec
        rng = np.random.default_rng(spec.gating_seed)
        popularity = -spec.gating_skew * np.log(np.arange(1, spec.experts + 1, dtype=np.float64))
        scores = popularity + rng.gumbel(size=(vocab_size, spec.experts))
        # Gumbel top-k: k distinct experts, expert e chosen with probability ~ popularity[e]
        self.table = np.argpartition(-scores, spec.top_k - 1, axis=1)[:, :spec.top_k].astype(np.int32)
        self.rank_of = (np.arange(spec.experts) // (spec.experts // spec.ep_ranks)).astype(np.int32)

    def experts_of(self, token_id: int) -> list[int]:
        """The experts a token is routed to (sorted)."""
        return sorted(int(e) for e in self.table[token_id])

    def step(self, tokens: Sequence[np.ndarray], stats: Sequence[MoeStats]) -> StepCost:
        """Cost of one step whose requests computed `tokens[i]` (token ids); accumulates each
        request's experts and per-EP-rank assignments into `stats[i]`."""
        spec = self.spec
        ep = spec.ep_ranks
        lengths = [len(t) for t in tokens]
        if not tokens or sum(lengths) == 0:
            return StepCost(0.0, 0.0, 1.0, [0] * ep)
        ids = np.concatenate(tokens)
        experts = self.table[ids]                               # [n, k]
        ranks = self.rank_of[experts]                           # [n, k]
        owner = np.repeat(np.arange(len(tokens)), lengths)      # request index of each token
        per_req_rank = np.zeros((len(tokens), ep), dtype=np.int64)
        np.add.at(per_req_rank, (owner[:, None], ranks), 1)
        per_req_expert = np.zeros((len(tokens), spec.experts), dtype=bool)
        per_req_expert[owner[:, None], experts] = True
        per_rank = per_req_rank.sum(axis=0)
        top, mean = float(per_rank.max()), float(per_rank.mean())
        cost = StepCost(spec.dispatch_ms + top * spec.expert_ms_per_token,
                        (top - mean) * spec.expert_ms_per_token, top / mean if mean else 1.0,
                        [int(x) for x in per_rank])
        for i, st in enumerate(stats):
            if not lengths[i]:
                continue
            if st.experts is None:
                st.experts = per_req_expert[i].copy()
                st.tokens_per_ep_rank = per_req_rank[i].copy()
            else:
                st.experts |= per_req_expert[i]
                st.tokens_per_ep_rank += per_req_rank[i]
        return cost
