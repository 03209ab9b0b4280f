"""`kvlab twin`: the workload through one or more policies on N simulated replicas, in virtual time.

    kvlab twin --topology quickstart --policy round-robin,kv-aware --replicas 16 --requests 5000
    kvlab twin --trace mooncake-conversation --replicas 16 --requests 10000 --profile qwen3-32b-tp2-h100
    kvlab twin --config my-twin.yaml         # TwinSettings keys (twin/settings.py)

Settings are checked before anything runs (unknown topology, policy, profile, workload or trace
line; replicas outside 1-128). Writes runs/<id>-twin/: per policy summary.json and requests.jsonl,
and compare.json (its `twin` section: the settings), compare.html, report.html (docs/twin.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kvlab.compare.results import table
from kvlab.config import convert, read_yaml
from kvlab.errors import ConfigError
from kvlab.gateway.config import PRESETS
from kvlab.load.stages import parse
from kvlab.twin import output
from kvlab.twin.runner import TwinResult, plans, run
from kvlab.twin.settings import TwinSettings

# flag -> Information field
_INFO_FLAGS = {"kv_event_delay_ms": "KV events reach the index this long after the engine step (ms)",
               "kv_event_batch_ms": "KV events applied in windows of this length (ms; 0: per engine step)",
               "scrape_interval_ms": "load view scraped this often (ms; 0: always fresh)",
               "speculative_ttl_s": "speculative blocks' TTL (s; default: the policy's; 0: off)",
               "tokenize_ms_per_1k": "gateway tokenization cost per 1,000 prompt tokens (ms)",
               "request_overhead_ms": "fixed client-to-engine cost per request (ms)"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab twin", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of twin settings (flags override it)")
    p.add_argument("--topology", help="shipped topology name or YAML path (default quickstart)")
    p.add_argument("--policy", help="comma-separated policies, or `all` (default: the topology's)")
    p.add_argument("--epp-config", help="an llm-d/GIE EndpointPickerConfig YAML instead of --policy")
    p.add_argument("--replicas", type=int,
                   help="replicas (default: the topology's); a P/D topology keeps its pools' ratio, a data-parallel "
                        "replica brings its ranks; 1-128 endpoints in all")
    p.add_argument("--profile", help="latency profile (default: the topology's sim profile)")
    p.add_argument("--num-blocks", type=int, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: the topology's / profile's)")
    p.add_argument("--workload", help="workload name (default: the topology's)")
    p.add_argument("--workload-params", help="JSON object of workload parameters")
    p.add_argument("--trace", help="Mooncake trace name or file: the trace workload at its own timing")
    p.add_argument("--requests", type=int, help="requests to send (default 1000)")
    p.add_argument("--duration", dest="duration_s", type=float,
                   help="also stop sending after this many virtual seconds (as a live phase)")
    p.add_argument("--users", type=int, help="closed-loop users (default 8 without --rate/--trace)")
    p.add_argument("--rate", type=float, help="open loop: requests/s")
    p.add_argument("--arrival", help="poisson | constant | gamma:CV (with --rate)")
    p.add_argument("--stages", help="a stepped ramp: RATE:SECONDS,... (inference-perf's stages; per-stage results)")
    p.add_argument("--warmup", help="warm-up stages before --stages: RATE:SECONDS,...")
    p.add_argument("--time-scale", type=float, help="a trace's timestamps times this")
    p.add_argument("--seed", type=int)
    p.add_argument("--perfect", action="store_true", help="the router sees everything at once (upper bound)")
    for name, help_ in _INFO_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float, help=help_)
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle's ceiling (saves memory at scale)")
    p.add_argument("--out", help="run directory (default runs/<time>-twin)")
    return p


def settings_of(args: argparse.Namespace) -> TwinSettings:
    """The typed settings from --config and the flags (a ConfigError for anything wrong)."""
    data: dict[str, Any] = dict(read_yaml(args.config) or {}) if args.config else {}
    info: dict[str, Any] = dict(data.get("information") or {})
    for key in ("topology", "replicas", "profile", "num_blocks", "block_size", "workload", "trace", "requests",
                "duration_s", "users", "rate", "arrival", "time_scale", "seed",
                "epp_config"):
        if (value := getattr(args, key)) is not None:
            data[key] = value
    if args.stages or args.warmup:
        stages = (parse(args.warmup, warmup=True) if args.warmup else []) + (parse(args.stages) if args.stages else [])
        data["stages"] = msgspec.to_builtins(stages)
    if args.workload_params is not None:
        try:
            data["workload_params"] = json.loads(args.workload_params)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--workload-params is not JSON: {exc}") from None
    for key in _INFO_FLAGS:
        if (value := getattr(args, key)) is not None:
            info[key] = value
    if args.perfect:
        info["perfect"] = True
    data["information"] = info
    return convert(data, TwinSettings, args.config or "kvlab twin")


def policies_of(text: str | None) -> list[str]:
    if text is None:
        return []
    names = list(PRESETS) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ConfigError("--policy names no policy")
    return names


def document(results: list[TwinResult], argv: list[str]) -> dict[str, Any]:
    first = results[0].plan
    s = first.settings
    return {"command": "kvlab twin " + " ".join(argv), "source": output.SOURCE,
            "settings": msgspec.to_builtins(s), "information": msgspec.to_builtins(first.information),
            "topology": first.topology.name, "profile": first.profile_name, "replicas": first.replicas,
            "num_blocks": first.num_blocks, "users": first.users, "seed": s.seed,
            "workload": first.workload.describe(),
            "runs": {r.plan.policy.name: {"wall_s": round(r.wall_s, 3), "virtual_s": round(r.outcome.virtual_s, 3),
                                          "speedup": round(r.speedup, 1), "engine_steps": r.outcome.steps,
                                          "requests_per_s": round(len(r.records) / r.wall_s, 1) if r.wall_s else None,
                                          "speculative_confirmed": r.outcome.speculative_confirmed,
                                          "speculative_expired": r.outcome.speculative_expired}
                     for r in results}}


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        settings = settings_of(args)
        todo = plans(settings, policies_of(args.policy))
    except ConfigError as exc:
        console.print(f"[red]kvlab twin:[/red] {exc}")
        return 2
    first = todo[0]
    console.print(f"twin · {first.topology.name} · {first.replicas} replicas × {first.num_blocks} blocks · "
                  f"profile {first.profile_name} · {first.workload.name} · {first.settings.requests} requests · "
                  f"{'perfect information' if first.information.perfect else 'live-like information'}")
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        for plan in todo:
            task = bar.add_task(plan.policy.name, total=plan.settings.requests)

            def advance(n: int, task: TaskID = task) -> None:
                if n % 100 == 0:
                    bar.update(task, completed=n)

            results.append(run(plan, oracle=not args.no_oracle, progress=advance))
    from kvlab.stack.state import new_run_dir, set_latest

    run_dir = Path(args.out) if args.out else new_run_dir("twin")
    run_dir.mkdir(parents=True, exist_ok=True)
    for r in results:
        output.write_policy(run_dir, r.plan.policy.name, r.summary, r.records)
    rows = [output.compare_row(r.plan.policy.name, r.summary, r.oracle) for r in results]
    note = (f"oracle: Belady on one pooled cache of {first.replicas} × {first.num_blocks} blocks"
            if not args.no_oracle else "oracle skipped (--no-oracle)")
    pages = output.write_pages(run_dir, document(results, argv), {r.plan.policy.name: r.summary for r in results},
                             {r.plan.policy.name: r.records for r in results}, rows, note)
    if not args.out:
        set_latest(run_dir)
    console.print(table(first.workload.name, rows, note))
    for r in results:
        console.print(f"{r.plan.policy.name}: {len(r.records)} requests, {r.outcome.virtual_s:.0f} s simulated in "
                      f"{r.wall_s:.1f} s ({len(r.records) / r.wall_s:.0f} requests/s, {r.speedup:.0f}× real time)")
    if first.stages:
        output.write_stages(run_dir, {r.plan.policy.name: r.summary for r in results})
    console.print(f"[green]wrote[/green] {pages['report']} and {pages['compare']} (figures from the twin)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

