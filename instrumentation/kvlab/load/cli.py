"""`kvlab bench`: one headless Locust run of a workload against a target; prints the summary.

Closed-loop users by default; `--rate` (open loop) or `--trace` (a production trace replayed)
send at scheduled times instead (load/options.py, docs/open-loop.md)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import msgspec
from rich.console import Console

from kvlab.errors import KvlabError
from kvlab.load import options
from kvlab.load.runner import run_bench
from kvlab.load.spec import BenchSpec
from kvlab.load.summary import LATE_MS
from kvlab.load.table import summary_table
from kvlab.load.workloads import NAMES
from kvlab.run.presets import LAB
from kvlab.stack.base import read_info
from kvlab.stack.state import runs_dir
from kvlab.vocabulary import old_spelling


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab bench", description=__doc__)
    p.add_argument("--target", help="base URL of an OpenAI-compatible API, or cluster:gateway | cluster:baseline "
                                    "for a kind cluster (default: the gateway of runs/latest)")
    p.add_argument("--context", default="kind-kvlab", help="kube context of a cluster: target")
    p.add_argument("--namespace", default="kvlab", help="namespace of a cluster: target")
    p.add_argument("--workload", choices=NAMES, help="default shared-prefix")
    p.add_argument("--workload-params", default="{}", help='workload parameters as JSON, e.g. \'{"groups": 16}\'')
    old_spelling(p, "--params", "--workload-params")
    p.add_argument("--users", type=int, help=f"closed-loop users (default {LAB.users}, the lab's; not with --rate)")
    p.add_argument("--spawn-rate", type=float, help="users started per second (default: all at once)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's prompts and arrivals (default 0)")
    p.add_argument("--model", default=None, help="served model name (default: the stack's, else kvlab-tiny)")
    p.add_argument("--phase", default="bench", help="label for the records")
    p.add_argument("--run-dir", help="where to write (default: runs/latest/bench-<time>, else runs/bench-<time>)")
    old_spelling(p, "--out", "--run-dir")
    options.add_arguments(p, sweep=False)
    return p


def resolve_target(target: str, context: str | None, namespace: str) -> str:
    """A URL as given; `cluster:gateway|baseline` through the kind path (docs/kind.md)."""
    if not target.startswith("cluster:"):
        return target
    from kvlab.stack.kind.forward import cluster_target

    return cluster_target(target.removeprefix("cluster:"), context=context, namespace=namespace)


def _spec(args: argparse.Namespace, model: str) -> BenchSpec:
    """The bench spec of the command line, every option checked (before anything starts)."""
    options.check(args)
    workload, params = (options.trace_workload(args)
                        or (args.workload or "shared-prefix", json.loads(args.workload_params)))
    spec = BenchSpec(workload=workload, params=params, users=args.users or LAB.users, spawn_rate=args.spawn_rate,
                     duration_s=args.duration, seed=args.seed, model=model)
    return options.specs(args, spec)[0]


def _plan(spec: BenchSpec) -> str:
    if spec.arrival is not None:
        return f"{spec.workload}, open loop at {spec.arrival.rate:g} req/s ({spec.arrival.label})"
    if spec.time_scale is not None:
        return f"trace replayed at its timestamps × {spec.time_scale:g}"
    return f"{spec.workload}, {spec.users} users"


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    console = Console()
    try:
        spec = _spec(args, "kvlab-tiny")
    except (KvlabError, ValueError) as exc:
        console.print(f"kvlab bench: {exc}", style="red", markup=False)
        return 2
    # a cluster target has nothing to do with the local stack (its model, run dir, OTLP endpoint)
    stack = None if (args.target or "").startswith("cluster:") else read_info(runs_dir() / "latest")
    target = args.target or (stack.gateway if stack else None)
    if not target:
        console.print("[red]kvlab bench: no --target and no running stack (start one with `kvlab up`)[/red]")
        return 2
    try:
        target = resolve_target(target, args.context, args.namespace)
    except KvlabError as exc:
        console.print(f"kvlab bench: {exc}", style="red", markup=False)
        return 1
    model = args.model or (stack.topology.model if stack and stack.topology else None) or "kvlab-tiny"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.run_dir) if args.run_dir else (Path(stack.run_dir) if stack else runs_dir()) / f"bench-{stamp}"
    try:
        spec = msgspec.structs.replace(spec, model=model)
        with console.status(f"Locust: {_plan(spec)}, {args.duration:.0f} s against {target}"):
            summary = run_bench(target, out, spec, phase=args.phase,
                                otlp_endpoint=stack.otlp_endpoint if stack else None)
    except (KvlabError, ValueError) as exc:
        console.print(f"kvlab bench: {exc}", style="red", markup=False)
        return 1
    console.print(summary_table({args.phase: summary}))
    if (loop := summary.open_loop) is not None and loop.behind:
        console.print(f"[yellow]![/yellow] the dispatcher fell behind: {loop.late} of {loop.sent} sends were more than "
                      f"{LATE_MS:.0f} ms late (p99 {loop.lateness_ms.p99:.0f} ms); this machine could not send "
                      f"{loop.offered_rps:g} req/s on time")
    console.print(f"records: {out / 'requests.jsonl'}\nsummary: {out / 'summary.json'}")
    return 0 if summary.ok else 1
