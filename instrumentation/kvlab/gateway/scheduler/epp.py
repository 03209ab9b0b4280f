"""A scheduler from an llm-d / GIE EndpointPickerConfig (gateway/epp_config.py): its one
scheduling profile's filters -> weighted scorers -> picker, each plug-in looked up by its `type` in
kvlab's registry (registry.py) and built from its `parameters`; a type kvlab does not know is
refused by name. Upstream's plug-ins are registered under their upstream names (prefix_cache.py,
precise_prefix_cache.py, kv_utilization.py, waiting_queue.py, epp_pickers.py); kvlab's own under
theirs, so a kvlab preset can be written the same way (kvlab/assets/epp/kv-aware-epp.yaml).

As upstream's loader (kubernetes-sigs/gateway-api-inference-extension `pkg/epp/config/loader/`):
a scorer's weight defaults to 1, a profile without a picker gets `max-score-picker`, and the
profile handler (`single-profile-handler`) is the only one there is here.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvlab.errors import ConfigError
from kvlab.gateway.config import EPP_PRESETS, IndexSettings, PolicyConfig, epp_path, load_policy
from kvlab.gateway.epp_config import EndpointPickerConfig, PluginSpec, read
from kvlab.gateway.scheduler.base import Filter, Picker, Plugin, Ranker, Scorer
from kvlab.gateway.scheduler.epp_pickers import MaxScorePicker
from kvlab.gateway.scheduler.precise_prefix_cache import PrecisePrefixCacheScorer
from kvlab.gateway.scheduler.registry import FILTERS, PICKERS, SCORERS

# plug-ins registered under upstream's names, for EndpointPickerConfig files only (a kvlab policy's
# `weights:` and `picker:` name kvlab's own)
UPSTREAM = frozenset({"prefix-cache-scorer", "precise-prefix-cache-scorer", "kv-cache-utilization-scorer",
                      "queue-scorer", "max-score-picker", "random-picker"})
# upstream's earlier names for the same plug-ins
ALIASES = {"kv-cache-scorer": "kv-cache-utilization-scorer"}
PROFILE_HANDLERS = ("single-profile-handler",)


def _plugin(spec: PluginSpec, rng: random.Random) -> Plugin | None:
    """The plug-in an entry of `plugins:` makes (None: the profile handler)."""
    kind = ALIASES.get(spec.type, spec.type)
    if kind in PROFILE_HANDLERS:
        if spec.parameters:
            raise ConfigError(f"plugin {spec.type!r} takes no parameters")
        return None
    if kind == "prefix-cache-scorer" and spec.parameters.get("mode") == "cache_tracking":
        # llm-d-inference-scheduler's earlier prefix-cache-scorer in its KV-event (precise) mode
        kind = PrecisePrefixCacheScorer.name
    table: dict[str, type[Plugin]] = {**FILTERS, **SCORERS, **PICKERS}
    cls = table.get(kind)
    if cls is None:
        known = sorted({*table, *ALIASES, *PROFILE_HANDLERS})
        raise ConfigError(f"unknown plugin type {spec.type!r} (plugin {spec.ref!r}); kvlab knows: {', '.join(known)}")
    return cls.from_epp(spec.parameters, rng)


def ranker(cfg: EndpointPickerConfig, rng: random.Random | None = None) -> Ranker:
    rng = rng or random.Random()
    built = {spec.ref: _plugin(spec, rng) for spec in cfg.plugins}
    filters: list[Filter] = []
    scorers: list[tuple[Scorer, float]] = []
    picker: Picker | None = None
    for ref in cfg.scheduling_profiles[0].plugins:
        p = built[ref.plugin_ref]
        if ref.weight is not None and not isinstance(p, Scorer):
            raise ConfigError(f"plugin {ref.plugin_ref!r} is not a scorer: it takes no weight")
        if isinstance(p, Filter):
            filters.append(p)
        elif isinstance(p, Scorer):
            scorers.append((p, 1.0 if ref.weight is None else ref.weight))
        elif isinstance(p, Picker):
            if picker is not None:
                raise ConfigError(f"profile {cfg.scheduling_profiles[0].name!r} has two pickers")
            picker = p
    if len({s.name for s, _ in scorers}) != len(scorers):
        raise ConfigError("a scorer type appears twice in the profile (kvlab keys scores by type)")
    return Ranker(filters, scorers, picker or MaxScorePicker(rng))


def policy_of(path: str | Path) -> PolicyConfig:
    """The gateway policy an EndpointPickerConfig file makes: its scheduler, and the index its
    prefix scorer reads (precise for KV events, approximate otherwise), checked by building it."""
    p = Path(path)
    cfg = read(p)
    r = ranker(cfg, random.Random(0))
    kinds = {s.index_kind for s, _ in r.scorers if s.index_kind is not None}
    if len(kinds) > 1:
        raise ConfigError(f"{p}: prefix scorers on both indexes ({', '.join(sorted(kinds))})")
    blocks = [s.block_size for s, _ in r.scorers if isinstance(s, PrecisePrefixCacheScorer)]
    index = IndexSettings(kind="approximate" if kinds == {"approximate"} else "precise",
                          default_block_size=blocks[0] if blocks else IndexSettings().default_block_size)
    return PolicyConfig(name=p.stem, description=f"EndpointPickerConfig {p.name}", index=index, epp=cfg)


def load(name: str | None, config_file: str | Path | None = None) -> PolicyConfig:
    """A policy by name: a shipped EndpointPickerConfig (kvlab/assets/epp/<name>.yaml) or a kvlab
    preset with `config_file` merged over it (config.load_policy)."""
    if name in EPP_PRESETS and not config_file:
        return policy_of(epp_path(name))
    return load_policy(name, config_file)
