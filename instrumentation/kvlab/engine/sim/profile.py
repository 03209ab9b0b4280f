"""Latency profiles: the numbers behind the simulator's step-time model, read from profiles.yaml.

A step that computes P prefill tokens while D sequences decode takes

    step_overhead_ms + P * prefill_ms_per_token + (decode_ms_base + D * decode_ms_per_seq if D else 0)

milliseconds, times the run's time scale. Sources of every profile are cited in docs/simulator.md.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvlab.config import Strict, load_yaml
from kvlab.engine.sim.moe import MoeSpec
from kvlab.errors import ConfigError


class LatencyProfile(Strict):
    """One engine/model/hardware combination. Engine sizes are defaults the flags override."""

    description: str
    source: str
    step_overhead_ms: float          # scheduler + launch cost every step pays
    prefill_ms_per_token: float      # per prompt token actually computed (cache hits skip it)
    decode_ms_base: float            # a step with decoding sequences: weight reads, sampling
    decode_ms_per_seq: float         # each decoding sequence in the batch (its KV reads)
    kv_transfer_ms_fixed: float = 0.0      # P/D: a decode replica's KV pull (handshake, notification)
    kv_transfer_ms_per_token: float = 0.0  # P/D: per token pulled (KV bytes per token / link bandwidth)
    block_size: int = 16
    num_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    moe: MoeSpec | None = None       # mixture-of-experts layers (moe.py); None: a dense model

    def step_ms(self, prefill_tokens: int, decode_seqs: int) -> float:
        """Modelled duration of one engine step, in milliseconds (unscaled)."""
        ms = self.step_overhead_ms + prefill_tokens * self.prefill_ms_per_token
        if decode_seqs:
            ms += self.decode_ms_base + decode_seqs * self.decode_ms_per_seq
        return ms


    def transfer_ms(self, tokens: int) -> float:
        """Modelled duration of pulling `tokens` tokens of KV from a prefill replica (unscaled)."""
        return self.kv_transfer_ms_fixed + tokens * self.kv_transfer_ms_per_token


class ProfileFile(Strict):
    profiles: dict[str, LatencyProfile]


def default_path() -> Path:
    return Path(str(resources.files("kvlab.engine.sim") / "profiles.yaml"))


def load_profiles(path: str | Path | None = None) -> dict[str, LatencyProfile]:
    """Every profile of a profiles file (the shipped one by default)."""
    return load_yaml(path or default_path(), ProfileFile).profiles


def get_profile(name: str, path: str | Path | None = None) -> LatencyProfile:
    """A profile by name, or a ConfigError listing the known ones."""
    profiles = load_profiles(path)
    if name not in profiles:
        raise ConfigError(f"unknown latency profile {name!r}; known: {', '.join(sorted(profiles))}")
    return profiles[name]

