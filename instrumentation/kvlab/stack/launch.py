"""What every kvlab child process is started with, rendered in one place.

The local stack, the scaler, the notebooks' extra gateways and the kind manifests all start the
same two programs (`kvlab engine`, `kvlab gateway`) from the same topology. Their arguments and
their OpenTelemetry environment are rendered here, so a new simulator or gateway setting is one
line in this module and reaches every way of starting them. Callers add only what is theirs
(ports, ready files, the discovery mode) and the program prefix (`KVLAB` locally, `kvlab` in a pod).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvlab.lifecycle import free_port
from kvlab.telemetry.sampling import ratio_env
from kvlab.topology import GatewaySettings, Pool, SimSettings, Topology, VllmSettings

__all__ = ["HOST", "KVLAB", "child_env", "engine_argv", "free_port", "gateway_args", "otel_env",
           "sim_args", "sim_argv", "vllm_args"]

HOST = "127.0.0.1"
KVLAB = [sys.executable, "-m", "kvlab.cli"]   # the local prefix of every kvlab child


def sim_args(s: SimSettings) -> list[str]:
    """`kvlab engine sim` flags of the topology's simulator settings (local and in a pod)."""
    args = ["--profile", s.profile, "--time-scale", str(s.time_scale), "--block-size", str(s.block_size),
            "--max-num-seqs", str(s.max_num_seqs), "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--max-model-len", str(s.max_model_len), "--seed", str(s.seed)]
    if s.num_blocks is not None:
        args += ["--num-blocks", str(s.num_blocks)]
    if s.cpu_kv_blocks:
        args += ["--cpu-kv-blocks", str(s.cpu_kv_blocks)]
    if s.typed_retention is not None:
        args += ["--typed-retention", str(s.typed_retention)]
    return args


def vllm_args(v: VllmSettings, log_dir: Path) -> list[str]:
    """`kvlab engine vllm` flags of the topology's vLLM settings (local: the launcher runs vLLM)."""
    args = ["--block-size", str(v.block_size), "--max-model-len", str(v.max_model_len),
            "--kv-cache-space-gib", str(v.kv_cache_space_gib), "--log-dir", str(log_dir)]
    if v.num_blocks is not None:
        args += ["--num-blocks", str(v.num_blocks)]
    if v.model_dir:
        args += ["--model-dir", v.model_dir]
    if v.extra_args:
        args += ["--", *v.extra_args]
    return args


def engine_argv(topology: Topology, pool: Pool, name: str, ready_file: Path, log_dir: Path) -> list[str]:
    """`kvlab engine sim|vllm ...` for one local pool (the caller adds its ports)."""
    args = [*KVLAB, "engine", topology.engine, "--replicas", str(pool.replicas), "--host", HOST,
            "--name", name, "--model", topology.model, "--ready-file", str(ready_file)]
    if topology.tokenizer:
        args += ["--tokenizer", topology.tokenizer]
    if pool.role != "both":
        args += ["--role", pool.role]
    if pool.data_parallel_size > 1:
        args += ["--data-parallel-size", str(pool.data_parallel_size)]
    if topology.engine == "sim":
        return args + sim_args(topology.sim)
    return args + vllm_args(topology.vllm, log_dir)


def sim_argv(name: str, ready_file: Path, flags: Sequence[str]) -> list[str]:
    """`kvlab engine sim` on loopback with the caller's own flags (an experiment's replicas)."""
    return [*KVLAB, "engine", "sim", "--host", HOST, "--name", name, *flags, "--ready-file", str(ready_file)]


def gateway_args(g: GatewaySettings, *, policy: str, model: str | None, host: str, port: int,
                 config: str | None = None, tokenizer: str | None = None) -> list[str]:
    """`gateway ...` with `policy` (the caller adds its discovery: an endpoints file or kubernetes)."""
    args = ["gateway", "--host", host, "--port", str(port), "--policy", policy,
            *(["--model", model] if model else []), "--scrape-interval-ms", str(g.scrape_interval_ms)]
    if config:
        args += ["--config", config]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    return args


def otel_env(service: str, otlp_endpoint: str | None, sample_ratio: float = 1.0) -> dict[str, str]:
    """The OpenTelemetry variables of one child: its service name and where its spans go (OTLP/HTTP,
    exported every second so a learner's trace shows up at once), or no export at all."""
    if not otlp_endpoint:
        return {"OTEL_SERVICE_NAME": service, "OTEL_TRACES_EXPORTER": "none"}
    return {"OTEL_SERVICE_NAME": service, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "1000", **ratio_env(sample_ratio)}


def child_env(service: str, otlp_endpoint: str | None, sample_ratio: float = 1.0,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its own OTLP exporter settings, plus `otel_env` (a child
    exports to the stack's endpoint or nowhere, never to one the user's shell happened to set)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    own = otel_env(service, otlp_endpoint, sample_ratio)
    if "OTEL_BSP_SCHEDULE_DELAY" in env:   # the user's schedule wins
        own.pop("OTEL_BSP_SCHEDULE_DELAY", None)
    return env | own
