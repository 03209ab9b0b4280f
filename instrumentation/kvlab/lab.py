"""`kvlab lab` (what `make lab` runs): cache-blind vs KV-aware on the same replicas, workload and seed.

A topology with `gateway.autoscale` runs the ramping-load autoscaling scenario instead
(kvlab.scenarios.autoscale, docs/autoscaling.md); one with `faults:` kills a replica under load
and restarts it (kvlab.scenarios.outage, docs/reliability.md).

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
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from kvlab.doctor import preflight
from kvlab.errors import KvlabError
from kvlab.load import options
from kvlab.load.spec import BenchSpec
from kvlab.load.workloads import NAMES, create
from kvlab.report.outcome import comparison, finish
from kvlab.run.command import fail, guarded
from kvlab.run.document import ClusterRun, Machine, RunDocument, read_run
from kvlab.run.phases import Phase, RichDisplay, run_phases
from kvlab.run.presets import LAB, LAB_QUICK, Preset
from kvlab.run.routers import local_routers, resolve
from kvlab.stack.state import new_run_dir, set_latest
from kvlab.topology import Topology, load_topology, resolve_topology

DEFAULT_POLICIES = "round-robin,kv-aware"
MIN_REQUESTS = 30   # a phase runs until its duration *and* this many completed requests (or its limit)
__all__ = ["comparison", "main", "parser", "run_lab", "workload_params"]

DEFAULT_TOPOLOGY = {"sim": "quickstart", "vllm": "vllm"}   # by --engine, when no --topology is given


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab lab", description=__doc__.splitlines()[0])
    p.add_argument("--topology", help="labs/topologies name or YAML file (default: quickstart; "
                                      "vllm with --engine vllm)")
    p.add_argument("--engine", choices=["sim", "vllm"], help="override the topology's engine")
    p.add_argument("--replicas", type=int, help="override the number of replicas (single-pool topologies)")
    p.add_argument("--workload", choices=NAMES, help="default: the topology's `workload:` (shared-prefix)")
    p.add_argument("--workload-params", default="{}", help="JSON object of workload parameters")
    p.add_argument("--duration", type=float,
                   help=f"seconds per phase (default {LAB.duration_s:.0f}, quick {LAB_QUICK.duration_s:.0f})")
    p.add_argument("--users", type=int,
                   help=f"concurrent Locust users (default {LAB.users}: enough to queue at the quickstart's two "
                        f"replicas; "
                        f"quick {LAB_QUICK.users}, as compare)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's prompts and arrivals (default 0)")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma-separated routers, one phase each: gateway presets or peers such as "
                        "vllm-router:cache_aware (docs/compare.md)")
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
    options.add_arguments(p)
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


def bench_spec(args: argparse.Namespace, topology: Topology, preset: Preset) -> BenchSpec:
    """The bench spec of `kvlab lab ARGS` (parsed once here; the workload's parameters validated now)."""
    traced = options.trace_workload(args) if getattr(args, "trace", None) else None
    name, params = traced or (args.workload or topology.workload.name, {})
    if traced is None:
        params = workload_params(topology, name, json.loads(args.workload_params))
        create(name, seed=args.seed, params=params)
    return BenchSpec(workload=name, params=params, users=args.users or preset.users,
                     duration_s=args.duration or preset.duration_s, seed=args.seed, model=topology.model,
                     min_requests=args.min_requests, limit_s=args.phase_limit,
                     trace_sample_ratio=topology.observability.sample_ratio)


def _run_dir(args: argparse.Namespace, label: str) -> Path:
    run_dir = Path(args.run_dir).absolute() if args.run_dir else new_run_dir(label)
    run_dir.mkdir(parents=True, exist_ok=True)
    set_latest(run_dir)
    return run_dir


def _load(spec: BenchSpec, sweep: list[BenchSpec] | None = None) -> dict[str, Any]:
    """How the load was sent: closed-loop users, or an open loop's rates (a trace's timing)."""
    if spec.arrival is not None:
        rates = ",".join(f"{s.arrival.rate:g}" for s in sweep or [spec] if s.arrival)
        return {"open loop": f"{spec.arrival.label} at {rates} req/s"}
    if spec.time_scale is not None:
        return {"open loop": f"trace timestamps × {spec.time_scale:g}"}
    return {"users": spec.users}


def _plan(spec: BenchSpec, phases: list[Phase]) -> str:
    params = json.dumps(spec.params) + " " if spec.params else ""
    load = ", ".join(f"{k} {v}" if k != "users" else f"{v} users" for k, v in _load(spec).items())
    return (f"workload {spec.workload} {params}(seed {spec.seed}) · {load} · "
            f"{spec.duration_s:.0f} s per phase · phases: {' → '.join(p.name for p in phases)}")


def run_lab(args: argparse.Namespace, console: Console) -> Path | None:
    """The run directory; None for `--cluster --dry-run` (nothing ran)."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.cluster:
        if args.engine or args.replicas is not None:
            raise KvlabError("--cluster runs what `kvlab cluster deploy` deployed: --engine and --replicas "
                             "do not apply (deploy another --topology instead)")
        topology = load_topology(resolve_topology(args.topology or DEFAULT_TOPOLOGY["sim"]))
        options.check(args)
        [spec, *more] = options.specs(args, bench_spec(args, topology, LAB_QUICK if args.quick else LAB))
        if more:
            raise KvlabError("--cluster runs one rate: --rate, not --rates")
        return run_cluster_lab(args, topology, spec, console)
    topology = _topology(args)
    _open(args, topology)
    if topology.gateway.autoscale is not None:   # the ramping-load autoscaling scenario
        from kvlab.scenarios.autoscale import run_autoscale

        return run_autoscale(topology, bench_spec(args, topology, LAB), console,
                             policies[0] if args.policies != DEFAULT_POLICIES else topology.gateway.policy,
                             quick=args.quick, duration_s=args.duration, users=args.users,
                             run_dir=Path(args.run_dir) if args.run_dir else None)
    if topology.faults is not None:   # a replica killed under load and restarted
        from kvlab.scenarios.outage import run_outage

        return run_outage(topology, bench_spec(args, topology, LAB), console,
                          policies[0] if args.policies != DEFAULT_POLICIES else topology.gateway.policy,
                          quick=args.quick, duration_s=args.duration, users=args.users,
                          run_dir=Path(args.run_dir) if args.run_dir else None)
    resolve(policies)   # an unknown router fails here, before anything starts
    specs = options.specs(args, bench_spec(args, topology, LAB_QUICK if args.quick else LAB))
    if len(specs) == 1:
        return run_local_lab(args, topology, specs[0], [Phase(p, p) for p in policies], console)
    # a rate sweep: every policy at every rate, `<policy>@<rate>`
    return run_local_lab(args, topology, specs[0], [Phase(p, p) for p in policies], console, sweep=specs)


def _open(args: argparse.Namespace, topology: Topology) -> None:
    """The open-loop options checked before anything starts (not for the autoscale scenario)."""
    options.check(args)
    if topology.gateway.autoscale is not None and (args.rate or args.rates or args.trace):
        raise KvlabError("the autoscale scenario ramps closed-loop users: --rate/--rates/--trace do not apply")
    if topology.faults is not None and (args.rate or args.rates or args.trace):
        raise KvlabError("the faults scenario runs closed-loop users: --rate/--rates/--trace do not apply")


def run_local_lab(args: argparse.Namespace, topology: Topology, spec: BenchSpec, phases: list[Phase],
                  console: Console, sweep: list[BenchSpec] | None = None) -> Path:
    """The phases on a local stack (replicas started once, a fresh gateway per phase); with `sweep`,
    the phases once per spec (rate), named `<policy>@<rate>`."""
    doctor = preflight(console, topology.engine)
    run_dir = _run_dir(args, "lab")
    console.rule(f"[bold]kvlab lab[/bold] {run_dir.name}")
    console.print(f"{topology.total_replicas} {topology.engine} replicas · {_plan(spec, phases)}")
    started = time.monotonic()
    with local_routers(console, topology, run_dir, resolve([p.policy for p in phases]), doctor.advice) as stack, \
            RichDisplay(console, waiting="starting router...") as display:   # presets and peers alike
        if sweep is None:
            results = run_phases(stack, spec, phases, run_dir, display)
        else:
            results = []
            for each in sweep:
                rate = f"@{each.arrival.rate:g}" if each.arrival else ""
                results += run_phases(stack, each, [Phase(p.name + rate, p.policy) for p in phases], run_dir,
                                      display, first=len(results) + 1)
    document = RunDocument(
        id=run_dir.name, run_dir=str(run_dir), engine=topology.engine,
        replicas=topology.total_replicas, topology=msgspec.to_builtins(topology),
        workload=create(spec.workload, seed=spec.seed, params=spec.params).describe(), users=spec.users,
        duration_s=spec.duration_s, quick=args.quick, policies=[p.policy for p in phases],
        wall_s=round(time.monotonic() - started, 1), min_requests=spec.min_requests,
        machine=Machine(isa=doctor.cpu.isa.level, isa_source=doctor.cpu.isa.source, cores=doctor.cpu.cores,
                        dtype=doctor.choices.dtype if topology.engine == "vllm" else None),
    )
    meta = {"run": run_dir.name, "engine": topology.engine, "replicas": topology.total_replicas,
            "workload": spec.workload, "seed": spec.seed, **_load(spec, sweep), "seconds per phase": spec.duration_s}
    finish(console, run_dir, results, document, meta,
           f"{stack.base.traces_dir or stack.otlp_endpoint or 'off'}  (kvlab traces explain)")
    return run_dir


def run_cluster_lab(args: argparse.Namespace, topology: Topology, spec: BenchSpec, console: Console) -> Path | None:
    """`kvlab lab --cluster`: the cache-blind baseline Service, then the gateway (or the routers
    `--policies` names: baseline, gateway-api, llm-d, the gateway's policy) of a kind cluster deployed
    with `kvlab cluster deploy`, each after resetting every replica pod's prefix cache."""
    from kvlab.stack.kind.cluster import ClusterStack
    from kvlab.stack.kind.phases import kind_cluster, lab_plan, policy_warning, print_lab_plan

    policy = topology.gateway.policy
    planned = lab_plan(None if args.policies == DEFAULT_POLICIES else args.policies.split(","), topology)
    if args.dry_run:
        print_lab_plan(planned, topology, kind_cluster(args.context, args.namespace), console.file)
        return None
    phases = [Phase(p.name, p.policy, entry=p.target) for p in planned]
    run_dir = _run_dir(args, "lab")
    console.rule(f"[bold]kvlab lab --cluster[/bold] {run_dir.name}")
    console.print(f"cluster {args.context}/{args.namespace} · {_plan(spec, phases)}")
    started = time.monotonic()
    with ClusterStack(run_dir, args.context, args.namespace, topology=topology.name, policy=policy,
                      warn=lambda m: console.print(m, style="yellow", markup=False)) as stack, \
            RichDisplay(console, waiting="resetting prefix caches...") as display:
        results = run_phases(stack, spec, phases, run_dir, display)
    if warning := policy_warning(results, policy):
        console.print(warning, style="yellow", markup=False)
    resets = {r.phase.name: r.resets for r in results}
    pods = sorted({k.rsplit(":", 1)[0] for r in resets.values() for k in r})
    document = RunDocument(
        id=run_dir.name, run_dir=str(run_dir), engine=None, replicas=len(pods),
        cluster=ClusterRun(context=args.context, namespace=args.namespace, replica_pods=pods,
                           cache_resets=dict(resets)),
        topology=msgspec.to_builtins(topology),
        workload=create(spec.workload, seed=spec.seed, params=spec.params).describe(), users=spec.users,
        duration_s=spec.duration_s, quick=args.quick, policies=[p.policy for p in phases],
        wall_s=round(time.monotonic() - started, 1),
    )
    meta = {"run": run_dir.name, "cluster": f"{args.context}/{args.namespace}", "replica pods": len(pods),
            "workload": spec.workload, "seed": spec.seed, "users": spec.users,
            "seconds per phase": spec.duration_s}
    traces = "Jaeger in the cluster (kvlab cluster forward jaeger)" + \
        ("" if stack.otlp_endpoint else "; client spans not exported")
    finish(console, run_dir, results, document, meta, traces)
    return run_dir


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    console = Console()
    done: list[Path | None] = []
    code = guarded(console, "lab", lambda: done.append(run_lab(args, console)), "every process was stopped")
    if code:
        return code
    if done[0] is None:   # --cluster --dry-run
        return 0
    if any(s.ok == 0 for s in read_run(done[0] / "summary.json").phases.values()):
        return fail(console, "lab", "a phase completed no request; see the logs under the run dir")
    return 0
