"""`kvlab compare`: the same replicas and the same seeded workload through several routers in one run.

The replicas start once (the simulator, or real vLLM with `--engine vllm`); per workload and per
router: reset every replica's prefix cache, start the router (a kvlab preset through kvlab's gateway,
or a peer such as vllm-router), run the workload, stop the router. `--cluster` measures the routers
a kind cluster already runs instead (compare/cluster.py). Writes runs/<id>/compare.json and
compare.html and prints one table per workload (docs/compare.md).
"""

from __future__ import annotations

import argparse
import shlex
import time
from contextlib import AbstractContextManager
from pathlib import Path

import msgspec
from rich.console import Console

from kvlab.compare.cluster import cluster_routers, default_routers, print_plan, refuse_local
from kvlab.compare.results import Row, ceiling_for, kv_path_warning, request_counts, row, table
from kvlab.compare.sweep import Sweep, behind, sweep
from kvlab.compare.sweep import table as sweep_table
from kvlab.doctor import Report, preflight
from kvlab.errors import ConfigError
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.lab import DEFAULT_TOPOLOGY, _run_dir, _topology, bench_spec
from kvlab.load import options
from kvlab.load.runner import Progress
from kvlab.load.spec import BenchSpec
from kvlab.load.workloads import NAMES, create
from kvlab.load.workloads.trace import NAMED as TRACE_NAMES
from kvlab.run.command import guarded
from kvlab.run.document import ClusterRun, Machine, RunDocument, Section, write_run
from kvlab.run.phases import Display, Phase, PhaseResult, RichDisplay, run_phases
from kvlab.run.presets import COMPARE, LAB
from kvlab.run.routers import RoutedStack, Router, capacity, commands, local_routers, resolve
from kvlab.tokenizer import Tokenizer
from kvlab.topology import Topology
from kvlab.vocabulary import old_spelling

DEFAULT_ROUTERS = "round-robin,prefix,kv-aware,vllm-router:cache_aware,vllm-router:kv_aware"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab compare", description=__doc__.splitlines()[0])
    p.add_argument("--policies",
                   help="comma-separated routers: kvlab presets, vllm-router:<policy>, or names given with --router "
                        f"(default {DEFAULT_ROUTERS}); with --cluster: baseline, gateway-api, llm-d and the "
                        "deployed gateway's policy (default: all four)")
    old_spelling(p, "--routers", "--policies")
    p.add_argument("--router", action="append", default=[], metavar="NAME=COMMAND",
                   help="another router to start, as a command template: {port} (required), {host}, "
                        "{metrics_port}, {model}, {block_size}; a word with {url}, {kv_events} or {replica} is "
                        "repeated per replica (docs/compare.md). Name it in --policies too. Not with --cluster.")
    p.add_argument("--engine", choices=["sim", "vllm"],
                   help="override the topology's engine (quickstart: sim). Not with --cluster.")
    p.add_argument("--topology", help="labs/topologies name or YAML file (default: quickstart; vllm with --engine "
                                      "vllm); with --cluster: the one the cluster was deployed with")
    p.add_argument("--replicas", type=int,
                   help="override the number of replicas (single-pool topologies). Not with --cluster.")
    p.add_argument("--workload", default=None,
                   help="comma-separated workloads, run one after another (default: the topology's): "
                        + ", ".join(NAMES))
    p.add_argument("--workload-params", default="{}", help="JSON object of workload parameters (one workload only)")
    p.add_argument("--duration", type=float, help=f"seconds per router (default {COMPARE.duration_s:.0f})")
    p.add_argument("--users", type=int, help=f"concurrent Locust users per router (default {COMPARE.users}: "
                                             f"five routers run in a row; `kvlab lab` sends {LAB.users})")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's prompts and arrivals (default 0)")
    p.add_argument("--min-requests", type=int, default=0,
                   help="a router also runs until this many requests completed (0: duration only)")
    p.add_argument("--phase-limit", type=float, help="seconds a router may take to reach --min-requests")
    p.add_argument("--run-dir", help="where to write (default: a new runs/<id>)")
    p.add_argument("--cluster", action="store_true",
                   help="start nothing: the routers of the kind cluster `kvlab cluster deploy` deployed")
    p.add_argument("--context", default="kind-kvlab", help="--cluster: the kube context")
    p.add_argument("--namespace", default="kvlab", help="--cluster: the namespace")
    p.add_argument("--dry-run", action="store_true",
                   help="--cluster: print the deploy steps and what each router benches; touch nothing")
    options.add_arguments(p)
    return p


def _specs(args: argparse.Namespace, topology: Topology) -> dict[str, BenchSpec]:
    """A spec per section: per workload, and with --rates per workload and rate (`<workload>@<rate>`)."""
    options.check(args)
    if args.trace:
        workloads = [trace_label(args.trace)]
    else:
        workloads = [w.strip() for w in (args.workload or topology.workload.name).split(",") if w.strip()]
    if len(workloads) > 1 and args.workload_params.strip() not in {"", "{}"}:
        raise ConfigError("--workload-params applies to one workload; run the others separately")
    for w in workloads:
        if w not in NAMES and not args.trace:
            raise ConfigError(f"unknown workload {w!r}; choose one of: {', '.join(NAMES)}")
    out = {}
    for w in workloads:
        given = argparse.Namespace(**{**vars(args), "workload": None if args.trace else w})
        base = bench_spec(given, topology, COMPARE)
        specs = options.specs(args, base)
        for spec in specs:
            out[f"{w}@{spec.arrival.rate:g}" if args.rates and spec.arrival else w] = spec
    return out


def trace_label(trace: str) -> str:
    """A trace's section name: its name, or its file's stem."""
    return trace if trace in TRACE_NAMES else Path(trace).stem


class Labelled:
    """The rich progress, each bar named `workload · router`."""

    def __init__(self, display: RichDisplay, label: str) -> None:
        self.display, self.label = display, label

    def begin(self, number: int, phase: Phase, total_s: float) -> Progress:
        return self.display.begin(number, Phase(f"{self.label} · {phase.name}", phase.policy), total_s)

    def end(self) -> None:
        self.display.end()


def measure(stack: RoutedStack, topology: Topology, spec: BenchSpec, routers: list[Router], out: Path,
            display: Display, tokenizer: PromptTokenizer) -> tuple[list[Row], dict[str, PhaseResult], str]:
    """Every router on one workload: (rows, each router's phase, what the oracle assumed)."""
    block_size, blocks = capacity(topology)
    workload = create(spec.workload, seed=spec.seed, params=spec.params)
    replicas = len(stack.replica_names())
    rows, results = [], {}
    for number, router in enumerate(routers, 1):
        before = request_counts(stack.replica_metrics())
        [result] = run_phases(stack, spec, [router.phase], out, display, first=number)
        after = request_counts(stack.replica_metrics())
        ceiling = ceiling_for(workload, result.records, block_size, replicas, blocks, tokenizer)
        rows.append(row(router.name, router.peer, result.summary, ceiling, before, after, stack.peer_counters()))
        results[router.name] = result
    cap = f"{replicas} × {blocks} blocks of {block_size}" if blocks else f"unbounded, blocks of {block_size}"
    return rows, results, f"oracle: Belady on one pooled cache of {cap}"


def _names(text: str) -> list[str]:
    names = [r.strip() for r in text.split(",") if r.strip()]
    if not names:
        raise ConfigError("--policies names no router")
    return names


def run_compare(argv: list[str], console: Console) -> Path | None:
    """The run directory; None for `--cluster --dry-run` (nothing ran)."""
    args = parser().parse_args(argv)
    if args.dry_run and not args.cluster:
        raise ConfigError("--dry-run applies to --cluster (a local compare starts its replicas)")
    if args.cluster:
        refuse_local(args)
    args.topology = args.topology or DEFAULT_TOPOLOGY[args.engine or "sim"]
    topology = _topology(args)
    if topology.gateway.autoscale is not None or len(topology.pools) != 1 or topology.pools[0].role != "both":
        raise ConfigError(f"topology {topology.name}: compare needs one pool of whole-request replicas")
    specs = _specs(args, topology)
    if args.cluster:
        planned = cluster_routers(_names(args.policies or default_routers(topology)), topology)
        if args.dry_run:
            print_plan(planned, topology, specs, args, console.file)
            return None
        routers = [r for r, _ in planned]
    else:
        routers = resolve(_names(args.policies or DEFAULT_ROUTERS), commands(args.router))
    doctor = None if args.cluster else preflight(console, topology.engine)
    run_dir = _run_dir(args, "compare")
    console.rule(f"[bold]kvlab compare[/bold] {run_dir.name}")
    first = next(iter(specs.values()))
    where = f"cluster {args.context}/{args.namespace}" if args.cluster else \
        f"{topology.total_replicas} {topology.engine} replicas"
    load = f"{first.users} users" if not first.open_loop else \
        f"open loop ({first.arrival.label if first.arrival else 'trace timing'})"
    console.print(f"{where} · workloads {', '.join(specs)} (seed {first.seed}) · {load} · "
                  f"{first.duration_s:.0f} s per router · routers: {', '.join(r.name for r in routers)}")
    tokenizer = PromptTokenizer(Tokenizer(topology.tokenizer)) if topology.tokenizer else PromptTokenizer()
    started = time.monotonic()
    sections: dict[str, Section] = {}
    results: dict[str, dict[str, PhaseResult]] = {}
    with _stack(args, topology, run_dir, routers, console, doctor) as stack, \
            RichDisplay(console, waiting="starting router...") as display:
        for w, spec in specs.items():
            rows, results[w], note = measure(stack, topology, spec, routers, run_dir / w, Labelled(display, w),
                                             tokenizer)
            sections[w] = Section(workload=create(spec.workload, seed=spec.seed, params=spec.params).describe(),
                                  oracle_note=note, routers=rows)
        replicas = stack.replica_names()
    document = RunDocument(
        id=run_dir.name, run_dir=str(run_dir), command="kvlab compare " + shlex.join(argv),
        engine=topology.engine, replicas=len(replicas), topology=msgspec.to_builtins(topology),
        routers=[r.name for r in routers], users=first.users, duration_s=first.duration_s,
        seed=first.seed, wall_s=round(time.monotonic() - started, 1),
        machine=Machine(isa=doctor.cpu.isa.level, cores=doctor.cpu.cores) if doctor else None,
        workloads=sections, slo=first.slo, sweeps=_sweeps(specs, sections),
    )
    if args.cluster:   # the replicas are the ready pods; what each reset answered, per workload and router
        document.cluster = ClusterRun(context=args.context, namespace=args.namespace, replica_pods=replicas,
                                      cache_resets={w: {n: r.resets for n, r in by.items()}
                                                    for w, by in results.items()})
    write_run(run_dir / "compare.json", document)
    from kvlab.report.compare import write_compare

    report = write_compare(run_dir / "compare.html", document,
                           {w: {n: r.records for n, r in by.items()} for w, by in results.items()})
    for w, section in sections.items():
        console.print(table(w, section.routers, section.oracle_note))
        for warning in filter(None, map(kv_path_warning, section.routers)):
            console.print(f"[yellow]![/yellow] {w} · {warning}")
    for sw in document.sweeps.values():
        console.print(sweep_table(sw))
        if behind(sw):
            console.print("[yellow]![/yellow] the dispatcher fell behind at some rates (the `late` column): those "
                          "rows understate the offered load")
    if args.cluster:
        from kvlab.stack.kind.phases import policy_warning

        if wrong := policy_warning((r for by in results.values() for r in by.values()), topology.gateway.policy):
            console.print(wrong, style="yellow", markup=False)
    console.print(f"report:  {report}\nresults: {run_dir / 'compare.json'}")
    return run_dir


def _sweeps(specs: dict[str, BenchSpec], sections: dict[str, Section]) -> dict[str, Sweep]:
    """Per workload swept over several rates (sections `<workload>@<rate>`), its curves."""
    by: dict[str, dict[str, list[Row]]] = {}
    for name, spec in specs.items():
        if "@" in name and spec.arrival is not None:
            by.setdefault(name.rsplit("@", 1)[0], {})[name] = sections[name].routers
    first = next(iter(specs.values()))
    return {w: sweep(w, rows, first.slo) for w, rows in by.items()}


def _stack(args: argparse.Namespace, topology: Topology, run_dir: Path, routers: list[Router], console: Console,
           doctor: Report | None) -> AbstractContextManager[RoutedStack]:
    """The replicas started here behind `routers` (doctor's advice on a failure), or with `--cluster`
    the kind cluster's, which it neither starts nor stops."""
    if doctor is not None:
        return local_routers(console, topology, run_dir, routers, doctor.advice)
    from kvlab.stack.kind.cluster import ClusterStack

    return ClusterStack(run_dir, args.context, args.namespace, topology=topology.name, policy=topology.gateway.policy,
                        warn=lambda m: console.print(m, style="yellow", markup=False))


def main(argv: list[str]) -> int:
    console = Console()
    return guarded(console, "compare", lambda: run_compare(argv, console), "every process was stopped")

