"""`kvlab engine sim`: N simulated vLLM replicas in one process, one event loop.

Prints one JSON line when every replica listens (and writes it atomically to --ready-file):
`{"replicas": [{"name", "url", "kv_events", "role", "dp_rank", "replica"}, ...]}`.
SIGTERM/SIGINT stop it cleanly. Flags are documented in docs/simulator.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import TYPE_CHECKING

import msgspec

from kvlab.engine.flags import add_common, port_list
from kvlab.errors import ConfigError
from kvlab.lifecycle import announce_ready, run, stop_requested
from kvlab.telemetry.setup import configure_tracing, shutdown_tracing

if TYPE_CHECKING:
    from kvlab.engine.sim.replica import Replica

log = logging.getLogger("kvlab.engine.sim")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab engine sim", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(p, "sim", "; a single replica is named NAME")
    p.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                   help="P/D role announced in the ready JSON (every replica speaks kv_transfer_params)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="data-parallel ranks per replica, one port each, named NAME-dpR (docs/wide-ep.md)")
    p.add_argument("--profile", default="cpu-tiny", help="latency profile name")
    p.add_argument("--profiles-file", help="profiles YAML (default: the shipped profiles.yaml)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every modelled duration (0.1 = ten times faster than the profile)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: the profile's)")
    p.add_argument("--num-blocks", type=int, help="KV blocks per replica (default: the profile's)")
    p.add_argument("--cpu-kv-blocks", type=int,
                   help="CPU offload tier per replica, in blocks (0: none; default: the profile's; docs/tiered.md)")
    p.add_argument("--max-num-seqs", type=int, help="running requests per step (default: the profile's)")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget per step (default: the profile's)")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens limit (default: the profile's)")
    p.add_argument("--seed", type=int, default=0, help="seed of generated tokens and block hashes")
    p.add_argument("--typed-retention", type=float, metavar="PINNED_SHARE",
                   help="honour retention directives (experimental, docs/semantic-kv.md); pinned blocks "
                        "are bounded to this share of the cache (0 <= share < 1)")
    p.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    return p


def build_replicas(args: argparse.Namespace) -> tuple[list[Replica], list[int]]:
    """The replicas described by parsed flags (not started)."""
    from kvlab.engine.sim.dp import lockstep_group
    from kvlab.engine.sim.length import check_cache
    from kvlab.engine.sim.profile import get_profile
    from kvlab.engine.sim.replica import EngineConfig, Replica
    from kvlab.engine.sim.sampler import Sampler
    from kvlab.tokenizer import Tokenizer

    if args.replicas < 1:
        raise ConfigError("--replicas must be at least 1")
    if args.time_scale <= 0:
        raise ConfigError("--time-scale must be positive")
    prof = get_profile(args.profile, args.profiles_file)
    cfg = EngineConfig(
        profile=prof, time_scale=args.time_scale,
        block_size=args.block_size or prof.block_size, num_blocks=args.num_blocks or prof.num_blocks,
        max_num_seqs=args.max_num_seqs or prof.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or prof.max_num_batched_tokens,
        max_model_len=args.max_model_len or prof.max_model_len, pinned_share=args.typed_retention,
        cpu_kv_blocks=prof.cpu_kv_blocks if args.cpu_kv_blocks is None else args.cpu_kv_blocks)
    if cfg.cpu_kv_blocks < 0:
        raise ConfigError("--cpu-kv-blocks must not be negative")
    if cfg.pinned_share is not None and not 0 <= cfg.pinned_share < 1:
        raise ConfigError("--typed-retention must be in [0, 1)")
    if min(cfg.block_size, cfg.num_blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) < 1:
        raise ConfigError("sizes must be positive")
    check_cache(cfg.max_model_len, cfg.num_blocks, cfg.block_size)
    tokenizer = Tokenizer(args.tokenizer)
    sampler = Sampler(tokenizer, args.seed)
    dp = args.data_parallel_size
    if dp < 1:
        raise ConfigError("--data-parallel-size must be at least 1")
    http_ports = port_list(args.ports, args.replicas * dp, "--ports")
    kv_ports = port_list(args.kv_events_ports, args.replicas * dp, "--kv-events-ports")
    replicas: list[Replica] = []
    for i in range(args.replicas):
        base = args.name if args.replicas == 1 else f"{args.name}-{i}"
        group = lockstep_group(cfg.profile, cfg.time_scale, tokenizer, dp)
        for r in range(dp):
            j = i * dp + r   # ports and hash seeds are per rank
            kv = None if args.no_kv_events else f"tcp://{args.host}:{kv_ports[j] or '*'}"
            replicas.append(Replica(base if dp == 1 else f"{base}-dp{r}", args.model, cfg, tokenizer, sampler, kv,
                                    hash_seed=args.seed * 1009 + j + 1, role=args.role,
                                    dp_rank=None if dp == 1 else r, replica=None if dp == 1 else base,
                                    group=group))
    return replicas, http_ports


async def serve(args: argparse.Namespace) -> None:
    replicas, ports = build_replicas(args)
    try:
        for replica, port in zip(replicas, ports):
            await replica.start(args.host, port)
        announce_ready({"replicas": msgspec.to_builtins([r.endpoint() for r in replicas])}, args.ready_file)
        await stop_requested()
    finally:
        for replica in replicas:
            with contextlib.suppress(Exception):
                await replica.stop()


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configure_tracing("kvlab-sim", export_process=True)
    try:
        run(serve(args))
    except ConfigError as exc:
        print(f"kvlab engine sim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. a port in use
        print(f"kvlab engine sim: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()
    return 0
