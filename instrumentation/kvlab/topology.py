"""The declarative lab description: which replicas, which roles, which routing policy, which
observability. Parsed once into typed objects; the local stack starts processes from it and the
kind path renders Kubernetes manifests from the very same object.

Example (labs/topologies/quickstart.yaml):

    name: quickstart
    engine: sim
    pools:
      - {name: replicas, role: both, replicas: 4}
    gateway: {policy: kv-aware}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from kvlab.config import Strict, load_yaml
from kvlab.errors import ConfigError
from kvlab.gateway.autoscale import AutoscaleSettings

Engine = Literal["sim", "vllm"]
Role = Literal["both", "prefill", "decode"]


class Pool(Strict, frozen=True):
    """A group of identical replicas."""

    name: str = "replicas"
    role: Role = "both"
    replicas: int = 4
    data_parallel_size: int = 1     # ranks per replica, one API port each (wide-EP)


class SimSettings(Strict, frozen=True):
    """Simulator settings shared by every simulated replica (see docs/simulator.md)."""

    profile: str = "cpu-tiny"
    time_scale: float = 1.0         # <1 runs faster than the profile, >1 slower
    block_size: int = 16
    num_blocks: int | None = None   # KV capacity in blocks; None = the profile's default
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    seed: int = 0
    cpu_kv_blocks: int = 0          # CPU offload tier per replica, in blocks (0: none; docs/tiered.md)
    typed_retention: float | None = None  # honour retention directives, pinned share bound (docs/semantic-kv.md)


class VllmSettings(Strict, frozen=True):
    """Real vLLM (CPU build) settings (see docs/vllm.md)."""

    model_dir: str | None = None    # None: the tiny model `kvlab model tiny` builds under runs/
    block_size: int = 128
    kv_cache_space_gib: float = 1.0
    num_blocks: int | None = None   # cap the KV cache at this many blocks (--num-gpu-blocks-override)
    max_model_len: int = 4096
    extra_args: list[str] = []


class GpuSettings(Strict, frozen=True):
    """vLLM on NVIDIA GPUs in kind (`kvlab cluster --gpu`, docs/kind.md). Several replicas can share
    one GPU: the device plugin's time-slicing hands out `replicas_per_gpu` slots per GPU and each
    replica takes `memory_utilization` of its GPU's memory."""

    model: str | None = None        # Hugging Face model vLLM serves; None: `--hf-model` or the pinned one
    gpus: int = 1                   # physical GPUs the topology is sized for (preflight checks them)
    replicas_per_gpu: int = 1       # >1: time-slicing, every replica gets a slice of a GPU
    memory_utilization: float = 0.9  # --gpu-memory-utilization of each replica
    block_size: int = 16
    num_blocks: int | None = None   # cap the KV cache (--num-gpu-blocks-override), the lab's lever
    min_gpu_memory_gib: float | None = None  # per GPU; what the slices were sized for

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.replicas_per_gpu < 1:
            raise ConfigError("topology: gpu.gpus and gpu.replicas_per_gpu must be >= 1")
        if not 0 < self.memory_utilization * self.replicas_per_gpu <= 0.95:
            raise ConfigError(f"topology: {self.replicas_per_gpu} replicas x gpu.memory_utilization "
                              f"{self.memory_utilization} must fit in 95 % of a GPU")


class GatewaySettings(Strict, frozen=True):
    policy: str = "kv-aware"
    config: str | None = None       # scheduler YAML (weights, thresholds); None = the policy preset
    scrape_interval_ms: int = 200
    # set: the gateway watches the endpoints file (--discovery file) with these recommender
    # settings as its policy's `autoscale:` section, and the local stack runs a Scaler acting on
    # the recommendation (docs/autoscaling.md); `kvlab lab` then runs the ramping-load scenario
    autoscale: AutoscaleSettings | None = None


class ObservabilitySettings(Strict, frozen=True):
    traces: str = "auto"            # auto | files | off | an OTLP/HTTP endpoint URL (e.g. a Jaeger)
    prometheus: Literal["auto", "off"] = "auto"
    sample_ratio: float = 1.0


class WorkloadSettings(Strict, frozen=True):
    """The workload a topology is sized for: `kvlab lab` runs it unless `--workload` names another
    (`--workload-params` override these parameters)."""

    name: str = "shared-prefix"
    params: dict[str, Any] = {}


class FaultSettings(Strict, frozen=True):
    """A replica lost under load (`kvlab lab` runs the outage scenario, kvlab.scenarios.outage): once
    the gateway has answered `after_requests`, pool `kill`'s engine processes are SIGKILLed; the
    phase ends `after_restart` requests after the replica answers again (docs/reliability.md)."""

    kill: str
    after_requests: int = 30
    after_restart: int = 60


class Topology(Strict, frozen=True):
    name: str = "lab"
    model: str = "kvlab-tiny"       # the served model name clients ask for
    engine: Engine = "sim"
    tokenizer: str | None = None    # HF tokenizer dir; None = kvlab's own
    pools: list[Pool] = msgspec.field(default_factory=lambda: [Pool()])
    sim: SimSettings = SimSettings()
    vllm: VllmSettings = VllmSettings()
    gpu: GpuSettings = GpuSettings()
    gateway: GatewaySettings = GatewaySettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    workload: WorkloadSettings = WorkloadSettings()
    faults: FaultSettings | None = None   # set: `kvlab lab` kills and restarts a replica under load

    def __post_init__(self) -> None:
        names = [p.name for p in self.pools]
        if not self.pools:
            raise ConfigError("topology: `pools` needs at least one pool")
        if len(set(names)) != len(names):
            raise ConfigError(f"topology: pool names must be unique, got {names}")
        for p in self.pools:
            if p.replicas < 0 or p.data_parallel_size < 1:
                raise ConfigError(f"topology: pool {p.name!r} needs replicas >= 0 and data_parallel_size >= 1")

        if self.faults is not None and self.faults.kill not in names:
            raise ConfigError(f"topology: faults.kill names no pool ({self.faults.kill!r}; pools {names})")
        if self.faults is not None and len(self.pools) < 2:
            raise ConfigError("topology: faults needs a second pool to resume the killed replica's requests on")

        slots = self.gpu.gpus * self.gpu.replicas_per_gpu
        if self.gpu.replicas_per_gpu > 1 and self.total_replicas > slots:
            raise ConfigError(f"topology: {self.total_replicas} replicas need more than the {slots} GPU slots "
                              f"(gpu.gpus x gpu.replicas_per_gpu)")

    @property
    def total_replicas(self) -> int:
        return sum(p.replicas for p in self.pools)


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file."""
    return load_yaml(path, Topology)


def builtin(name: str) -> Path:
    """Path of a topology shipped in labs/topologies/ (by file stem)."""
    root = Path(__file__).resolve().parents[2] / "labs" / "topologies"
    path = root / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in root.glob("*.yaml"))
        raise ConfigError(f"no topology named {name!r}; shipped ones: {', '.join(known) or 'none'}")
    return path


def resolve_topology(name_or_file: str) -> Path:
    """A topology file path, or the stem of one shipped in labs/topologies/."""
    path = Path(name_or_file)
    return path if path.suffix in {".yaml", ".yml"} or path.exists() else builtin(name_or_file)
