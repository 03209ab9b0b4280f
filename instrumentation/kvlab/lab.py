"""`kvlab lab` (what `make lab` runs): cache-blind vs KV-aware on the same replicas, workload and seed.

A topology with `gateway.autoscale` runs the ramping-load autoscaling scenario instead
(kvlab.scenarios.autoscale, docs/autoscaling.md).

Starts the replicas once (simulator by default), then per phase: reset every replica's prefix
cache, start the gateway with the phase's policy (round-robin first, kv-aware second), run the
Locust workload headless, stop the gateway. Writes runs/<id>/phase-N-<policy>/{requests.jsonl,
summary.json}, runs/<id>/summary.json (both phases and their ratios) and runs/<id>/report.html,
and prints the before/after table. docs/lab.md explains the phases and how to read the report.
`--cluster` runs the same comparison on a kind cluster instead: its cache-blind baseline Service,
then its gateway (`run_cluster_lab`, docs/kind.md).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvlab.doctor import preflight
from kvlab.errors import KvlabError, StackError
from kvlab.load.runner import run_bench
from kvlab.load.summary import read_jsonl
from kvlab.load.table import metric_value, summary_table
from kvlab.load.workloads import NAMES, create
from kvlab.report import write_report
from kvlab.report.html import headline
from kvlab.stack.cli import resolve_topology
from kvlab.stack.local import LocalStack
from kvlab.stack.state import new_run_dir, set_latest, write_json
from kvlab.topology import Topology, load_topology

DEFAULT_POLICIES = "round-robin,kv-aware"
FULL = {"duration": 60.0, "users": 12}
QUICK = {"duration": 25.0, "users": 8}
MIN_REQUESTS = 30   # a phase runs until its duration *and* this many completed requests (or its limit)
DEFAULT_TOPOLOGY = {"sim": "quickstart", "vllm": "vllm"}   # by --engine, when no --topology is given


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab lab", description=__doc__.splitlines()[0])
    p.add_argument("--topology", help="labs/topologies name or YAML file (default: quickstart; "
                                      "vllm with --engine vllm)")
    p.add_argument("--engine", choices=["sim", "vllm"], help="override the topology's engine")
    p.add_argument("--replicas", type=int, help="override the number of replicas (single-pool topologies)")
    p.add_argument("--workload", choices=NAMES, help="default: the topology's `workload:` (shared-prefix)")
    p.add_argument("--workload-params", default="{}", help="JSON object of workload parameters")
    p.add_argument("--duration", type=float, help=f"seconds per phase (default {FULL['duration']:.0f}, quick {QUICK['duration']:.0f})")
    p.add_argument("--users", type=int, help=f"concurrent Locust users (default {FULL['users']}, quick {QUICK['users']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated gateway policies, one phase each")
    p.add_argument("--quick", action="store_true", help="short phases (the CI check; ~1 minute in all)")
    p.add_argument("--min-requests", type=int, default=MIN_REQUESTS,
                   help="a phase also runs until this many requests completed (0: duration only)")
    p.add_argument("--phase-limit", type=float, help="seconds a phase may take to reach --min-requests before "
                                                     "the lab fails (default 4 × the duration)")
    p.add_argument("--run-dir", help="where to write (default: a new runs/<id>)")
    p.add_argument("--cluster", action="store_true", help="no local stack: the kind cluster's baseline Service, "
                                                          "then its gateway (docs/kind.md)")
    p.add_argument("--context", default="kind-kvlab", help="--cluster: the kube context")
    p.add_argument("--namespace", default="kvlab", help="--cluster: the namespace")
    p.add_argument("--dry-run", action="store_true", help="--cluster: print the deploy steps and phases; touch nothing")
    return p


def _topology(args: argparse.Namespace) -> Topology:
    topology = load_topology(resolve_topology(args.topology or DEFAULT_TOPOLOGY[args.engine or "sim"]))
    changes: dict[str, Any] = {}
    if args.engine:
        changes["engine"] = args.engine
    if args.replicas is not None:
        if len(topology.pools) != 1:
            raise KvlabError("--replicas needs a topology with one pool")
        changes["pools"] = [msgspec.structs.replace(topology.pools[0], replicas=args.replicas)]
    return msgspec.structs.replace(topology, **changes) if changes else topology


def workload_params(topology: Topology, workload: str, given: dict[str, Any]) -> dict[str, Any]:
    """The parameters the topology is sized for, overridden by the ones given on the command line."""
    sized = topology.workload.params if workload == topology.workload.name else {}
    return {**sized, **given}


def _live(records: list[dict[str, Any]]) -> str:
    ok = [r["ttft_ms"] for r in records if not r.get("error") and r.get("ttft_ms") is not None]
    errors = sum(1 for r in records if r.get("error"))
    p50 = f"{np.percentile(ok, 50):.0f} ms" if ok else "–"
    return f"{len(records)} requests, TTFT p50 {p50}, {errors} errors"


def comparison(summaries: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Ratios of the last phase against the first (what the lab's checks and headline use)."""
    first, last = list(summaries.values())[0], list(summaries.values())[-1]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {
        "ttft_p50_speedup": ratio(metric_value(first, ("ttft_ms", "p50")), metric_value(last, ("ttft_ms", "p50"))),
        "ttft_p95_speedup": ratio(metric_value(first, ("ttft_ms", "p95")), metric_value(last, ("ttft_ms", "p95"))),
        "delivered_hit_rate_gain": ratio(metric_value(last, ("hit_rate", "delivered")),
                                         metric_value(first, ("hit_rate", "delivered"))),
        "throughput_gain": ratio(last.get("rps"), first.get("rps")),
        "output_tok_s_gain": ratio(last.get("output_tok_s"), first.get("output_tok_s")),
    }


Prepare = Callable[[str], str]   # phase name -> the URL Locust targets, once that phase's caches are reset


def run_phases(console: Console, run_dir: Path, phases: list[tuple[str, str]], prepare: Prepare, *,
               workload: str, params: dict[str, Any], users: int, duration: float, seed: int, model: str,
               otlp_endpoint: str | None, waiting: str, min_requests: int = 0,
               limit_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Run each (name, policy) phase after `prepare` reset the caches and returned its target:
    runs/<id>/phase-N-<name>/; {name: {"summary", "records"}} in run order (what the report takes)."""
    out: dict[str, dict[str, Any]] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(bar_width=24), TimeElapsedColumn(),
                  TextColumn("{task.fields[live]}"), console=console) as progress:
        for n, (name, policy) in enumerate(phases, 1):
            task = progress.add_task(f"phase {n}: {name}", total=duration, live=waiting)
            target = prepare(name)

            def update(elapsed: float, records: list[dict[str, Any]], task=task) -> None:
                progress.update(task, completed=min(elapsed, duration), live=_live(records))

            phase_dir = run_dir / f"phase-{n}-{name}"
            summary = run_bench(target, phase_dir, workload=workload, params=params, users=users,
                                duration_s=duration, seed=seed, model=model, phase=name, policy=policy,
                                otlp_endpoint=otlp_endpoint, progress=update, min_requests=min_requests,
                                limit_s=limit_s)
            progress.update(task, completed=duration)
            out[name] = {"summary": summary, "records": read_jsonl(phase_dir / "requests.jsonl")}
    return out


def finish(console: Console, run_dir: Path, phases: dict[str, dict[str, Any]], document: dict[str, Any],
           meta: dict[str, Any], traces: str) -> None:
    """runs/<id>/summary.json (`document` + phases + comparison) and report.html; prints the table."""
    summaries = {p: v["summary"] for p, v in phases.items()}
    write_json(run_dir / "summary.json", {**document, "phases": summaries, "comparison": comparison(summaries)})
    report = write_report(run_dir / "report.html", phases, meta)
    console.print(summary_table(summaries, title="before → after"))
    console.print(f"[bold]{headline(summaries)}[/bold]")
    console.print(f"report:  {report}\nsummary: {run_dir / 'summary.json'}\ntraces:  {traces}")


def run_lab(args: argparse.Namespace, console: Console) -> Path | None:
    preset = QUICK if args.quick else FULL
    duration = args.duration or preset["duration"]
    users = args.users or preset["users"]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.cluster:
        return run_cluster_lab(args, console, duration, users)
    topology = _topology(args)
    name = args.workload or topology.workload.name
    params = workload_params(topology, name, json.loads(args.workload_params))
    workload = create(name, seed=args.seed, params=params)  # validates the parameters now
    if topology.gateway.autoscale is not None:   # the ramping-load autoscaling scenario
        from kvlab.scenarios.autoscale import run_autoscale

        return run_autoscale(args, topology, console, policies[0] if args.policies != DEFAULT_POLICIES
                             else topology.gateway.policy)
    doctor = preflight(console, topology.engine)
    run_dir = Path(args.run_dir).absolute() if args.run_dir else new_run_dir("lab")
    console.rule(f"[bold]kvlab lab[/bold] {run_dir.name}")
    console.print(f"{topology.total_replicas} {topology.engine} replicas · workload {workload.name} "
                  f"{json.dumps(params) + ' ' if params else ''}(seed {args.seed}) · {users} users · {duration:.0f} s per phase · phases: {' → '.join(policies)}")
    started = time.monotonic()
    with LocalStack(topology, run_dir) as stack:
        run_dir.mkdir(parents=True, exist_ok=True)
        set_latest(run_dir)
        with console.status("starting replicas and telemetry..."):
            stack.start_traces()
            stack.start_engines()
            stack.start_prometheus()
        console.print(f"[green]✓[/green] replicas up: {', '.join(r['name'] for r in stack.replicas)} "
                      f"({time.monotonic() - started:.0f} s); logs in {stack.logs}")

        def prepare(policy: str) -> str:
            stack.stop_gateway()
            stack.reset_caches()
            stack.start_gateway(policy)
            return stack.gateway_url

        try:
            phases = run_phases(console, run_dir, [(p, p) for p in policies], prepare, workload=workload.name,
                                params=params, users=users, duration=duration, seed=args.seed,
                                model=topology.model, otlp_endpoint=stack.otlp_endpoint,
                                waiting="starting gateway...", min_requests=args.min_requests,
                                limit_s=args.phase_limit)
        except StackError as exc:
            advice = "".join(f"\n  doctor: {a}" for a in doctor.advice)
            raise StackError(f"{exc}; {topology.engine} replica logs in {stack.logs}{advice}") from None
        stack.stop_gateway()
    document = {
        "id": run_dir.name, "run_dir": str(run_dir), "engine": topology.engine,
        "replicas": topology.total_replicas, "topology": msgspec.to_builtins(topology),
        "workload": workload.describe(), "users": users, "duration_s": duration, "quick": args.quick,
        "policies": policies, "wall_s": round(time.monotonic() - started, 1), "min_requests": args.min_requests,
        "machine": {"isa": doctor.cpu.isa.level, "isa_source": doctor.cpu.isa.source, "cores": doctor.cpu.cores,
                    "dtype": doctor.choices.dtype if topology.engine == "vllm" else None},
    }
    meta = {"run": run_dir.name, "engine": topology.engine, "replicas": topology.total_replicas,
            "workload": workload.name, "seed": args.seed, "users": users, "seconds per phase": duration}
    finish(console, run_dir, phases, document, meta,
           f"{stack.traces_dir or stack.otlp_endpoint or 'off'}  (kvlab traces explain)")
    return run_dir


def run_cluster_lab(args: argparse.Namespace, console: Console, duration: float, users: int) -> Path | None:
    """`kvlab lab --cluster`: the cache-blind baseline Service, then the gateway, of a kind cluster
    (deployed with `kvlab cluster deploy`), each after resetting every replica pod's prefix cache."""
    from kvlab.stack.kind.caches import reset_prefix_caches
    from kvlab.stack.kind.forward import cluster_target
    from kvlab.stack.kind.phases import lab_plan, print_lab_plan

    if args.engine or args.replicas is not None:
        raise KvlabError("--cluster runs what `kvlab cluster deploy` deployed: --engine and --replicas "
                         "do not apply (deploy another --topology instead)")
    topology = load_topology(resolve_topology(args.topology or DEFAULT_TOPOLOGY["sim"]))
    name = args.workload or topology.workload.name
    params = workload_params(topology, name, json.loads(args.workload_params))
    workload = create(name, seed=args.seed, params=params)
    policy = topology.gateway.policy
    # phases of routers on one cluster; the baseline's "policy" is kube-proxy's per-connection spreading
    phases_ = lab_plan(None if args.policies == DEFAULT_POLICIES else args.policies.split(","), topology)
    if args.dry_run:
        from kvlab.stack.kind.manifests import Cluster

        print_lab_plan(phases_, topology, Cluster(namespace=args.namespace, name=args.context.removeprefix("kind-")),
                       console.file)
        return None
    plan = [(p.name, p.policy) for p in phases_]
    targets = {p.name: p.target for p in phases_}
    where = {"context": args.context, "namespace": args.namespace}
    run_dir = Path(args.run_dir).absolute() if args.run_dir else new_run_dir("lab")
    run_dir.mkdir(parents=True, exist_ok=True)
    set_latest(run_dir)
    console.rule(f"[bold]kvlab lab --cluster[/bold] {run_dir.name}")
    console.print(f"cluster {args.context}/{args.namespace} · workload {workload.name} "
                  f"{json.dumps(params) + ' ' if params else ''}(seed {args.seed}) · {users} users · "
                  f"{duration:.0f} s per phase · phases: {' → '.join(name for name, _ in plan)}")
    resets: dict[str, dict[str, str | None]] = {}
    started = time.monotonic()

    def prepare(name: str) -> str:
        resets[name] = reset_prefix_caches(args.context, args.namespace)
        refused = {k: why for k, why in resets[name].items() if why}
        for target, why in refused.items():
            console.print(f"[yellow]warning: {target}: reset_prefix_cache refused: {why}; "
                          f"phase {name} starts with a warm cache[/yellow]")
        return cluster_target(targets[name], **where)

    phases = run_phases(console, run_dir, plan, prepare, workload=workload.name, params=params, users=users,
                        duration=duration, seed=args.seed, model=topology.model, otlp_endpoint=None,
                        waiting="resetting prefix caches...", min_requests=args.min_requests,
                        limit_s=args.phase_limit)
    answered = {r["policy"] for p in phases_ if p.target == "gateway"
                for r in phases[p.name]["records"] if r.get("policy")} - {policy}
    if answered:
        console.print(f"[yellow]warning: the gateway answered with policy {', '.join(sorted(answered))}, not "
                      f"{policy}: pass the --topology you deployed[/yellow]")
    pods = sorted({k.rsplit(":", 1)[0] for r in resets.values() for k in r})
    document = {
        "id": run_dir.name, "run_dir": str(run_dir), "engine": None, "replicas": len(pods),
        "cluster": {**where, "replica_pods": pods, "cache_resets": resets},
        "topology": msgspec.to_builtins(topology), "workload": workload.describe(), "users": users,
        "duration_s": duration, "quick": args.quick, "policies": [p for _, p in plan],
        "wall_s": round(time.monotonic() - started, 1),
    }
    meta = {"run": run_dir.name, "cluster": f"{args.context}/{args.namespace}", "replica pods": len(pods),
            "workload": workload.name, "seed": args.seed, "users": users, "seconds per phase": duration}
    finish(console, run_dir, phases, document, meta, "Jaeger in the cluster (kvlab cluster forward jaeger)")
    return run_dir


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    console = Console()
    try:
        run_dir = run_lab(args, console)
        if run_dir is None:   # --cluster --dry-run
            return 0
    except (KvlabError, ValueError) as exc:
        console.print(f"kvlab lab: {exc}", style="red", markup=False)
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process was stopped[/yellow]")
        return 130
    summary = json.loads((run_dir / "summary.json").read_text())
    if any(s["ok"] == 0 for s in summary["phases"].values()):
        console.print("[red]a phase completed no request; see the logs under the run dir[/red]")
        return 1
    return 0
