"""Build a Scheduler from a PolicyConfig (presets live in kvlab/assets/policies/*.yaml)."""

from __future__ import annotations

import random

from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.scheduler import pickers
from kvlab.gateway.scheduler.base import Scheduler
from kvlab.gateway.scheduler.inflight import InflightScorer
from kvlab.gateway.scheduler.inflight_tokens import InflightTokensScorer
from kvlab.gateway.scheduler.kv_usage import KvUsageScorer
from kvlab.gateway.scheduler.pending_prefill import PendingPrefillScorer
from kvlab.gateway.scheduler.predicted_ttft import PredictedTtftScorer
from kvlab.gateway.scheduler.prefix import PrefixScorer
from kvlab.gateway.scheduler.queue import QueueScorer


def build(cfg: PolicyConfig, rng: random.Random | None = None) -> Scheduler:
    """Every scorer always runs (so spans show all scores); a zero weight only removes its say."""
    tiers = cfg.index.tiers
    scorers = [PrefixScorer(tiers.gpu, tiers.cpu), QueueScorer(), KvUsageScorer(), InflightScorer(),
               InflightTokensScorer(), PendingPrefillScorer(), PredictedTtftScorer()]
    return Scheduler(cfg, scorers, pickers.make(cfg.picker, rng))
