"""Latency profiles: the numbers behind the simulator's step-time model, read from profiles.yaml.

A step that computes P prefill tokens at positions p_1..p_P, while D sequences decode and A
requests are scheduled for the first time, takes

    step_overhead_ms + P * prefill_ms_per_token + prefill_ms_per_token_per_1k_ctx * sum(p_i) / 1000
    + A * request_overhead_ms + (decode_ms_base + D * decode_ms_per_seq if D else 0)

milliseconds, times the run's time scale: attention makes a prompt token cost more the more context
it attends to. Sources of every profile are cited in docs/simulator.md.

Profiles come from the shipped profiles.yaml and, by name, from the user's own files
`$KVLAB_HOME/profiles/*.yaml` (KVLAB_HOME defaults to ~/.config/kvlab), which `kvlab calibrate`
writes; a user profile may not reuse a shipped name.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import msgspec
import yaml

from kvlab.config import Strict, load_yaml
from kvlab.engine.sim.moe import MoeSpec
from kvlab.errors import ConfigError


class LatencyProfile(Strict, frozen=True):
    """One engine/model/hardware combination. Engine sizes are defaults the flags override."""

    description: str
    source: str
    step_overhead_ms: float          # scheduler + launch cost every step pays
    prefill_ms_per_token: float      # per prompt token actually computed (cache hits skip it)
    decode_ms_base: float            # a step with decoding sequences: weight reads, sampling
    decode_ms_per_seq: float         # each decoding sequence in the batch (its KV reads)
    prefill_ms_per_token_per_1k_ctx: float = 0.0   # attention: extra per computed token per 1,000 positions before it
    request_overhead_ms: float = 0.0       # once per request, in the step that first schedules it (API server, IPC)
    kv_transfer_ms_fixed: float = 0.0      # P/D: a decode replica's KV pull (handshake, notification)
    kv_transfer_ms_per_token: float = 0.0  # P/D: per token pulled (KV bytes per token / link bandwidth)
    kv_load_ms_per_block: float = 0.0     # CPU tier: loading one block back to GPU (KV bytes per block / host link)
    cpu_kv_blocks: int = 0                # CPU tier size in blocks (0: no CPU tier); tier.py
    block_size: int = 16
    num_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    gpus_per_replica: int = 1        # GPUs one replica occupies (tensor parallelism); 0: a CPU process
    moe: MoeSpec | None = None       # mixture-of-experts layers (moe.py); None: a dense model

    def step_ms(self, prefill_tokens: int, decode_seqs: int, prefill_ctx_k: float = 0.0,
                admitted: int = 0, loaded_blocks: int = 0) -> float:
        """Modelled duration of one engine step, in milliseconds (unscaled). `prefill_ctx_k`: the sum
        of the prefill tokens' positions, in thousands; `admitted`: requests scheduled for the first time;
        `loaded_blocks`: blocks loaded from the CPU tier before the step runs."""
        ms = (self.step_overhead_ms + prefill_tokens * self.prefill_ms_per_token
              + prefill_ctx_k * self.prefill_ms_per_token_per_1k_ctx + admitted * self.request_overhead_ms
              + loaded_blocks * self.kv_load_ms_per_block)
        if decode_seqs:
            ms += self.decode_ms_base + decode_seqs * self.decode_ms_per_seq
        return ms


    def transfer_ms(self, tokens: int) -> float:
        """Modelled duration of pulling `tokens` tokens of KV from a prefill replica (unscaled)."""
        return self.kv_transfer_ms_fixed + tokens * self.kv_transfer_ms_per_token


class ProfileFile(Strict, frozen=True):
    profiles: dict[str, LatencyProfile]


def default_path() -> Path:
    return Path(str(resources.files("kvlab.engine.sim") / "profiles.yaml"))


def user_dir() -> Path:
    """Where the user's own profiles live: $KVLAB_HOME/profiles, KVLAB_HOME defaulting to
    $XDG_CONFIG_HOME/kvlab (~/.config/kvlab)."""
    home = os.environ.get("KVLAB_HOME") or Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "kvlab"
    return Path(home) / "profiles"


def load_profiles(path: str | Path | None = None) -> dict[str, LatencyProfile]:
    """Every profile of a profiles file; by default the shipped ones plus the user's (user_dir())."""
    if path is not None:
        return load_yaml(path, ProfileFile).profiles
    profiles = load_yaml(default_path(), ProfileFile).profiles
    folder = user_dir()
    for f in sorted(folder.glob("*.yaml")) if folder.is_dir() else ():
        for name, prof in load_yaml(f, ProfileFile).profiles.items():
            if name in profiles:
                raise ConfigError(f"{f}: profile {name!r} is already defined (shipped or in another file); rename it")
            profiles[name] = prof
    return profiles


def write_user_profile(name: str, profile: LatencyProfile) -> Path:
    """user_dir()/NAME.yaml holding one profile `name` (replaced if it exists)."""
    path = user_dir() / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"profiles": {name: {k: v for k, v in msgspec.to_builtins(profile).items() if v is not None}}}
    path.write_text(yaml.safe_dump(body, sort_keys=False, width=100))
    return path


def get_profile(name: str, path: str | Path | None = None) -> LatencyProfile:
    """A profile by name, or a ConfigError listing the known ones."""
    profiles = load_profiles(path)
    if name not in profiles:
        raise ConfigError(f"unknown latency profile {name!r}; known: {', '.join(sorted(profiles))}")
    return profiles[name]

