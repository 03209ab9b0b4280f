"""The gateway's policy configuration: typed, parsed once, with named presets.

A preset is a YAML file in `kvlab/assets/policies/<name>.yaml`. `--config FILE` is a YAML whose
keys are deep-merged over the preset named by `--policy` (or by its own `preset:` key), so a user
file only states what it changes. Every key is documented in docs/gateway.md.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from kvlab.config import Strict, convert, read_yaml
from kvlab.errors import ConfigError
from kvlab.gateway.autoscale import AutoscaleSettings
from kvlab.gateway.chunked.settings import ChunkedSettings
from kvlab.gateway.epp_config import EndpointPickerConfig
from kvlab.gateway.pull import PullSettings
from kvlab.gateway.retention import RetentionSettings

PRESETS = ("round-robin", "random", "least-load", "prefix", "kv-aware", "dp-aware", "rank-blind",
           "kv-aware-unified", "kv-aware-gpu-only", "kv-aware-pull", "kv-aware-chunked", "kv-aware-chunked-16",
           "kv-aware-chunked-256", "kv-aware-typed", "kv-aware-pin-all", "kv-aware-affinity",
           "vllm-router-cache-aware")
# EndpointPickerConfig files shipped in kvlab/assets/epp/ (llm-d's anchor, docs/twin.md "Anchors")
EPP_PRESETS = ("llm-d-approximate", "llm-d-precise", "kv-aware-epp")


class Weights(Strict, frozen=True):
    """Scorer weights; each scorer returns a value in [0, 1]; total = sum(weight * score)."""

    prefix: float = 0.0
    queue: float = 0.0
    kv_usage: float = 0.0
    inflight: float = 0.0
    inflight_tokens: float = 0.0         # prefill tokens in flight (per data-parallel rank, docs/wide-ep.md)
    pending_prefill: float = 0.0         # uncached prompt tokens not yet past their first token (gateway/prefill.py)
    predicted_ttft: float = 0.0          # learned cost per prefill token x (work ahead + own uncached tokens)


class Thresholds(Strict, frozen=True):
    """Filters: a replica above a threshold is not a candidate unless every replica is."""

    max_waiting: int | None = None        # vllm:num_requests_waiting
    max_kv_usage: float | None = None     # vllm:kv_cache_usage_perc, 0..1
    max_inflight: int | None = None       # requests the gateway has in flight to it


class CacheAwareSettings(Strict, frozen=True):
    """vllm-router's `cache_aware` policy (picker `cache-aware`): its settings and 0.1.17's defaults
    (`vllm-router --help`; vllm-project/router src/policies/cache_aware.rs)."""

    cache_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3   # match rate above which the tree decides
    balance_abs_threshold: Annotated[int, msgspec.Meta(ge=0)] = 64       # imbalanced: max - min load above this ...
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=0)] = 1.5    # ... and max above min times this


class Timeouts(Strict, frozen=True):
    connect_s: float = 2.0                # TCP connect to a replica
    first_byte_s: float = 120.0           # request sent -> response headers
    stream_idle_s: float = 60.0           # max gap between two streamed chunks
    total_s: float = 900.0                # whole upstream exchange
    scrape_s: float = 1.0                 # one /metrics scrape
    client_idle_s: float = 15.0           # a client connection with no complete request (slowloris)
    client_body_s: float = 30.0           # reading one request body


class Health(Strict, frozen=True):
    eject_after_failures: int = 3         # consecutive failed scrapes/connects before ejection
    readmit_after_s: float = 2.0          # an ejected replica is probed again after this
    scrape_interval_ms: int = 200


class Limits(Strict, frozen=True):
    max_body_bytes: int = 8 * 1024 * 1024
    max_prompt_tokens: int | None = None  # None: let the replica judge its model length
    max_retries: int = 2                  # extra replicas tried after a refused connection
    max_resumes: int = 3                  # a broken generation continued on another replica at most this often


class TierWeights(Strict, frozen=True):
    """A prefix block's weight by the tier holding it (docs/tiered.md); defaults: llm-d's precise
    scorer (DefaultKVCacheBackendConfig: gpu 1.0, cpu 0.8). cpu 0: CPU-tier blocks are ignored."""

    gpu: float = 1.0
    cpu: float = 0.8


class IndexSettings(Strict, frozen=True):
    # precise falls back to approximate per replica without a live event stream
    kind: Literal["precise", "approximate"] = "precise"
    default_block_size: int = 16          # until /metrics or events tell a replica's own
    approx_capacity_blocks: int = 100_000  # per replica, unless its num_gpu_blocks is known
    tiers: TierWeights = TierWeights()   # GPU vs CPU-offloaded blocks (KV events' `medium`)
    # a routed prompt's blocks count as held until BlockStored confirms them, at most this long
    # (0: off; docs/gateway.md)
    speculative_ttl_s: float = 30.0


class StaticEndpoint(Strict, frozen=True):
    """A replica listed in the config file (same fields as discovery.base.Endpoint)."""

    name: str
    url: str
    kv_events: str | None = None
    role: Literal["both", "prefill", "decode"] = "both"


class PDSettings(Strict, frozen=True):
    """Prefill/decode disaggregation (docs/pd.md). Active only when prefill-role endpoints exist:
    split when the chosen decode replica lacks at least `threshold_tokens` of the prompt."""

    enabled: bool = True                  # false: no split, and prefill-role replicas serve like `both`
    threshold_tokens: int = 256           # uncached prompt tokens on the decode replica that justify a remote prefill


class PolicyConfig(Strict, frozen=True):
    name: str
    description: str = ""
    picker: Literal["max-score", "round-robin", "random", "rank-blind", "cache-aware"] = "max-score"
    weights: Weights = Weights()
    thresholds: Thresholds = Thresholds()
    index: IndexSettings = IndexSettings()
    timeouts: Timeouts = Timeouts()
    health: Health = Health()
    limits: Limits = Limits()
    tokenize_cache_entries: int = 50_000
    kv_events_resync_s: float = 10.0      # gap-free events needed before a stale replica is trusted again
    # used when no --endpoints/--endpoints-file is given
    endpoints: list[StaticEndpoint] = msgspec.field(default_factory=list)
    pd: PDSettings = PDSettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()   # the desired-replica rule (docs/autoscaling.md)
    pull: PullSettings = PullSettings()   # cross-replica KV pull (gateway/pull.py, docs/tiered.md)
    chunked: ChunkedSettings = ChunkedSettings()         # chunked decoding, off by default (docs/chunked-decoding.md)
    retention: RetentionSettings = RetentionSettings()   # typed retention directives (docs/semantic-kv.md)
    cache_aware: CacheAwareSettings = CacheAwareSettings()   # the `cache-aware` picker (vllm-router's policy)
    # set: an llm-d/GIE EndpointPickerConfig decides, with its own plug-ins (gateway/scheduler/epp.py)
    epp: EndpointPickerConfig | None = None


def preset_path(name: str) -> Path:
    return Path(str(resources.files("kvlab") / "assets" / "policies" / f"{name}.yaml"))


def epp_path(name: str) -> Path:
    """A shipped EndpointPickerConfig (kvlab/assets/epp/<name>.yaml), which a policy name can point at."""
    return Path(str(resources.files("kvlab") / "assets" / "epp" / f"{name}.yaml"))


def _read(path: Path) -> dict[str, Any]:
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_policy(name: str | None, config_file: str | Path | None = None) -> PolicyConfig:
    """The preset `name`, with `config_file` merged over it. Raises ConfigError on any problem."""
    over: dict[str, Any] = {}
    if config_file:
        over = _read(Path(config_file))
        preset = over.pop("preset", None)
        name = name or preset
    if not name:
        raise ConfigError("no policy: pass --policy NAME or set `preset:` in the config file")
    path = preset_path(name)
    if name not in PRESETS or not path.is_file():
        if config_file and "name" in over:   # a fully custom policy
            return convert(over, PolicyConfig, str(config_file))
        raise ConfigError(f"unknown policy {name!r}; presets: {', '.join(PRESETS + EPP_PRESETS)}")
    data = _merge(_read(path), over)
    return convert(data, PolicyConfig, str(config_file or path))


def to_dict(cfg: PolicyConfig) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(cfg)
    return out
