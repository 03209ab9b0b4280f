"""Build a Ranker from a PolicyConfig (presets live in kvlab/assets/policies/*.yaml) out of the
registered plug-ins (registry.py)."""

from __future__ import annotations

import random

from kvlab.gateway.config import PolicyConfig, Weights
from kvlab.gateway.scheduler.base import Ranker
from kvlab.gateway.scheduler.registry import FILTERS, PICKERS, SCORERS, named


def build(cfg: PolicyConfig, rng: random.Random | None = None) -> Ranker:
    """Every filter and scorer always runs (so spans show all scores); a zero weight only removes
    a scorer's say; the policy's `picker` chooses."""
    rng = rng or random.Random()
    if cfg.epp is not None:   # an EndpointPickerConfig: its own plug-ins and weights
        from kvlab.gateway.scheduler.epp import ranker
        return ranker(cfg.epp, rng)
    filters = [f.from_policy(cfg, rng) for f in FILTERS.values()]
    scorers = [(s.from_policy(cfg, rng), float(getattr(cfg.weights, name))) for name, s in SCORERS.items()
               if name in Weights.__struct_fields__]   # kvlab's own (upstream's are for EPP configs)
    picker = named(PICKERS, "picker")(cfg.picker).from_policy(cfg, rng)
    return Ranker(filters, scorers, picker)
