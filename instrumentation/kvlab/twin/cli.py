"""`kvlab twin`: the workload through one or more policies on N simulated replicas, in virtual time.

    kvlab twin --topology quickstart --policies round-robin,kv-aware --replicas 16 --requests 5000
    kvlab twin --trace mooncake-conversation --replicas 16 --requests 10000 --profile h100-qwen3-32b-tp2
    kvlab twin --config my-twin.yaml         # TwinSettings keys (twin/settings.py)
    kvlab twin --trace mooncake-conversation --profile h100-llama3-8b --block-size 64 \
        --policies round-robin,kv-aware,dynamo-round-robin,dynamo-kv-router   # + Dynamo's own replay (twin/dynamo.py)

Policies run side by side, one process each (`--jobs`, default one per core up to 4): a run is one
core's work, so two policies on two cores take about as long as the slower one. Settings are
checked before anything runs (unknown topology, policy, profile, workload or trace
line; replicas outside 1-128; a max model length over the KV cache). A request longer than the max
model length is answered 400, as vLLM answers it; Ctrl-C or SIGTERM writes what had finished
(summaries marked partial). Writes runs/<id>-twin/: per policy summary.json and requests.jsonl,
and compare.json (its `twin` section: the settings), compare.html, report.html (docs/twin.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import msgspec
from rich.console import Console

from kvlab.compare.results import Row, table
from kvlab.config import convert, read_yaml
from kvlab.errors import ConfigError
from kvlab.gateway.config import PRESETS
from kvlab.load.stages import parse
from kvlab.run.command import signals_handled
from kvlab.twin import dynamo, output
from kvlab.twin.fit import describe
from kvlab.twin.progress import RunProgress
from kvlab.twin.runner import TwinResult, plans, run_all
from kvlab.twin.settings import Plan, TwinSettings
from kvlab.twin.workers import Interrupt, default_jobs

# flag -> Information field
_INFO_FLAGS = {"kv_event_delay_ms": "KV events reach the index this long after the engine step (ms)",
               "kv_event_batch_ms": "KV events applied in windows of this length (ms; 0: per engine step)",
               "scrape_interval_ms": "load view scraped this often (ms; 0: always fresh; else at least 1)",
               "speculative_ttl_s": "speculative blocks' TTL (s; default: the policy's; 0: off)",
               "tokenize_ms_per_1k": "gateway tokenization cost per 1,000 prompt tokens (ms)",
               "request_overhead_ms": "fixed client-to-engine cost per request (ms)"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab twin", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="YAML", help="YAML file of twin settings (flags override it)")
    p.add_argument("--topology", metavar="NAME", help="shipped topology name or YAML path (default quickstart)")
    p.add_argument("--policies", metavar="NAMES",
                   help="routing policies compared, comma-separated, or `all` (default: the topology's); "
                        "dynamo-round-robin, dynamo-kv-router: Dynamo's own replay beside them")
    p.add_argument("--policy", dest="policies", help=argparse.SUPPRESS)   # the old name
    p.add_argument("--epp-config", metavar="YAML", help="an llm-d/GIE EndpointPickerConfig YAML instead of --policies")
    p.add_argument("--replicas", type=int, metavar="N",
                   help="replicas (default: the topology's); a P/D topology keeps its pools' ratio, a data-parallel "
                        "replica brings its ranks; 1-128 endpoints in all")
    p.add_argument("--profile", metavar="NAME",
                   help="latency profile (default: the topology's; with --trace, the first shipped "
                        "profile that holds the trace's longest request when the topology's does not, or "
                        "the one that holds the most of its requests where none holds them all)")
    p.add_argument("--num-blocks", type=int, metavar="N",
                   help="KV blocks per replica (default: the topology's / profile's)")
    p.add_argument("--block-size", type=int, metavar="TOKENS",
                   help="tokens per KV block (default: the topology's / profile's)")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="longest request (prompt + max_tokens) a replica takes; longer ones are answered 400 "
                        "(default: the topology's / profile's; at most the KV cache)")
    p.add_argument("--workload", metavar="NAME", help="workload name (default: the topology's)")
    p.add_argument("--workload-params", metavar="JSON", help="JSON object of workload parameters")
    p.add_argument("--trace", metavar="NAME_OR_FILE",
                   help="Mooncake trace name or file: the trace workload at its own timing")
    p.add_argument("--requests", type=int, metavar="N",
                   help="requests to send (default 1000); a closed-loop user's session begun within "
                        "them runs to its end, so multi-turn workloads send more")
    p.add_argument("--duration", dest="duration_s", type=float, metavar="SECONDS",
                   help="also stop sending after this many virtual seconds (as a live phase)")
    p.add_argument("--users", type=int, metavar="N", help="closed-loop users (default 8 without --rate/--trace)")
    p.add_argument("--rate", type=float, metavar="RPS", help="open loop: requests/s")
    p.add_argument("--arrival", metavar="KIND", help="poisson | constant | gamma:CV (with --rate)")
    p.add_argument("--stages", metavar="RATE:SECONDS,...",
                   help="a stepped ramp (inference-perf's stages; per-stage results)")
    p.add_argument("--warmup", metavar="RATE:SECONDS,...", help="warm-up stages before --stages")
    p.add_argument("--time-scale", type=float, metavar="FACTOR", help="a trace's timestamps times this")
    p.add_argument("--seed", type=int, metavar="N", help="seed of the workload, arrivals and engines (default 0)")
    p.add_argument("--perfect", action="store_true", help="the router sees everything at once (upper bound)")
    for name, help_ in _INFO_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float, metavar="N", help=help_)
    p.add_argument("--jobs", type=int, metavar="N",
                   help="policies run side by side, one process each, N at a time (default: one per core, at most "
                        "4; 1: one after another in this process; each run holds its own memory)")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle's ceiling (saves memory at scale)")
    p.add_argument("--run-dir", metavar="DIR", help="where the run is written (default runs/<time>-twin)")
    p.add_argument("--out", dest="run_dir", help=argparse.SUPPRESS)   # the old name
    return p


def settings_of(args: argparse.Namespace) -> TwinSettings:
    """The typed settings from --config and the flags (a ConfigError for anything wrong)."""
    data: dict[str, Any] = dict(read_yaml(args.config) or {}) if args.config else {}
    info: dict[str, Any] = dict(data.get("information") or {})
    for key in ("topology", "replicas", "profile", "num_blocks", "block_size", "max_model_len", "workload", "trace",
                "requests", "duration_s", "users", "rate", "arrival", "time_scale", "seed", "epp_config"):
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
    return convert(data, TwinSettings, args.config or "flags")


def jobs_of(n: int | None) -> int:
    """--jobs, checked: processes side by side (default: one per core, at most 4)."""
    if n is None:
        return default_jobs()
    if n < 1:
        raise ConfigError(f"--jobs must be 1 or more (got {n}); 1 runs the policies one after another")
    return n


def policies_of(text: str | None) -> list[str]:
    if text is None:
        return []
    names = list(PRESETS) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ConfigError("--policies names no policy")
    return names


def document(first: Plan, results: list[TwinResult], replays: list[dynamo.DynamoResult],
             argv: list[str]) -> dict[str, Any]:
    s = first.settings
    return {"command": "kvlab twin " + " ".join(argv), "source": output.SOURCE,
            "settings": msgspec.to_builtins(s), "information": msgspec.to_builtins(first.information),
            "topology": first.topology.name, "profile": first.profile_name, "profile_reason": first.profile_reason,
            "max_model_len": first.max_model_len, "replicas": first.replicas,
            "num_blocks": first.num_blocks, "users": first.users, "seed": s.seed,
            "workload": first.workload.describe(),
            "runs": {r.plan.policy.name: {"wall_s": round(r.wall_s, 3), "virtual_s": round(r.outcome.virtual_s, 3),
                                          "speedup": round(r.speedup, 1), "engine_steps": r.outcome.steps,
                                          "requests_per_s": round(len(r.records) / r.wall_s, 1) if r.wall_s else None,
                                          "partial": r.summary.partial, "too_long": r.summary.too_long,
                                          "speculative_confirmed": r.outcome.speculative_confirmed,
                                          "speculative_expired": r.outcome.speculative_expired}
                     for r in results},
            **({"peers": {r.name: {"source": dynamo.source(), "wall_s": round(r.wall_s, 3),
                                   "virtual_s": round(r.virtual_s, 3), "engine": dynamo.engine_args(first),
                                   "arrival_speedup_ratio": 1 / s.time_scale,
                                   "kv_event_lag_ms": first.information.kv_event_delay_ms,
                                   "prefix_cache_reused_ratio": r.report.get("prefix_cache_reused_ratio")}
                           for r in replays}} if replays else {})}


def header(plan: Plan) -> list[str]:
    """What runs, and why this profile; a trace's requests no replica can hold."""
    lines = [f"twin · {plan.topology.name} · {plan.replicas} replicas × {plan.num_blocks} blocks · profile "
             f"{plan.profile_name} (max model length {plan.max_model_len:,}) · {plan.workload.name} · "
             f"{plan.settings.requests} requests · "
             f"{'perfect information' if plan.information.perfect else 'live-like information'}"]
    if plan.profile_reason:
        lines.append(f"profile {plan.profile_name}: {plan.profile_reason}")
    if plan.fit is not None and (note := describe(plan.fit, plan.profile_name)):
        lines.append(note)
    return lines


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        settings = settings_of(args)
        jobs = jobs_of(args.jobs)
        names, replays = dynamo.split(policies_of(args.policies))
        todo = plans(settings, names) if names or not replays else []
        first = todo[0] if todo else plans(settings, [])[0]
        if replays:
            dynamo.check(first)
    except ConfigError as exc:
        # not markup ("kvlab[dynamo]"), and one line in a log: whole, greppable
        console.print(f"kvlab twin: {exc}", style="red", markup=False, soft_wrap=True)
        return 2
    for line in header(first):
        console.print(line, highlight=False)
    with _sigterm_interrupts(), RunProgress(console) as bar:
        ran = run_all(todo, not args.no_oracle, lambda plan: bar.task(plan.policy.name, plan.settings.requests),
                      jobs)
    results = [r for r in ran.results if r.records]
    if not results and (ran.why is not None or not replays):
        console.print(f"[red]kvlab twin:[/red] {ran.why or 'nothing ran'}; nothing finished", soft_wrap=True)
        return 1
    peers = []
    if ran.why is None:
        for name in replays:
            with console.status(f"{name}: Dynamo's replay of {first.settings.requests} requests"):
                peers.append(dynamo.run(first, name))
    pages, rows, note = write(first, results, peers, argv, args.run_dir, args.no_oracle)
    console.print(table(first.workload.name, rows, note))
    for r in results:
        s = r.summary
        rate = len(r.records) / r.wall_s if r.wall_s else 0.0
        console.print(f"{r.plan.policy.name}: {len(r.records)} requests{' (partial)' if s.partial else ''}, "
                      f"{r.outcome.virtual_s:.0f} s simulated in {r.wall_s:.1f} s ({rate:.0f} requests/s, "
                      f"{r.speedup:.0f}× real time)", highlight=False)
        if s.too_long:
            console.print(f"{r.plan.policy.name}: {s.too_long} requests answered 400 (longer than the max model "
                          f"length {r.plan.max_model_len:,}; the longest prompt {s.too_long_prompt_max:,} tokens)",
                          highlight=False)
    for p in peers:
        console.print(f"{p.name}: {len(p.records)} requests, {p.virtual_s:.0f} s simulated in {p.wall_s:.1f} s by "
                      "Dynamo's replay", highlight=False)
    source = "the twin; the (peer) rows from Dynamo's replay" if peers else "the twin"
    console.print(f"[green]wrote[/green] {pages['report']} and {pages['compare']} (figures from {source})")
    if ran.why is not None:
        console.print(f"[red]kvlab twin:[/red] {ran.why}; wrote what had finished (summary marked partial)",
                      soft_wrap=True)
        cause = ran.cause
        return 130 if isinstance(cause, KeyboardInterrupt) else 143 if isinstance(cause, Interrupt) else 1
    return 0


def _oracle_note(first: Plan, skipped: bool) -> str:
    return ("oracle skipped (--no-oracle)" if skipped
            else f"oracle: Belady on one pooled cache of {first.replicas} × {first.num_blocks} blocks")


def write(first: Plan, results: list[TwinResult], peers: list[dynamo.DynamoResult], argv: list[str],
          run_dir_arg: str | None, no_oracle: bool) -> tuple[dict[str, Path], list[Row], str]:
    """Every file of the run (docs/twin.md), in --run-dir or a new runs/<time>-twin; its table rows and note."""
    from kvlab.stack.state import new_run_dir, set_latest

    run_dir = Path(run_dir_arg) if run_dir_arg else new_run_dir("twin")
    run_dir.mkdir(parents=True, exist_ok=True)
    summaries = {r.plan.policy.name: r.summary for r in results} | {r.name: r.summary for r in peers}
    records = {r.plan.policy.name: r.records for r in results} | {r.name: r.records for r in peers}
    for name, summary in summaries.items():
        output.write_policy(run_dir, name, summary, records[name])
    rows = [output.compare_row(r.plan.policy.name, r.summary, r.oracle) for r in results]
    ceiling = None if no_oracle or not peers else dynamo.oracle(first, dynamo.rows_of(first))
    rows += [output.compare_row(r.name, r.summary, ceiling, peer=True) for r in peers]
    note = _oracle_note(first, no_oracle)
    if peers:
        note += f"; the (peer) rows: {dynamo.source()}"
    pages = output.write_pages(run_dir, document(first, results, peers, argv), summaries, records, rows, note,
                               dynamo.source() if peers else None)
    if first.stages:
        output.write_stages(run_dir, {r.plan.policy.name: r.summary for r in results})
    if not run_dir_arg:
        set_latest(run_dir)
    return pages, rows, note


def _sigterm_interrupts() -> contextlib.AbstractContextManager[None]:
    """SIGTERM stops the run in progress as Ctrl-C does, so what finished is written."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise Interrupt("SIGTERM")

    return signals_handled(stop, signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

