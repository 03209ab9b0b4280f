"""`kvlab compare`: the same replicas and the same seeded workload through several routers in one run.

The replicas start once (the simulator, or real vLLM with `--engine vllm`); per workload and per
router: reset every replica's prefix cache, start the router (a kvlab preset through kvlab's gateway,
or a peer such as vllm-router), run the workload, stop the router. Writes runs/<id>/compare.json and
compare.html and prints one table per workload (docs/compare.md).
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from kvlab.compare.results import Row, ceiling_for, kv_path_warning, request_counts, row, table
from kvlab.compare.routers import Router, RouterStack, capacity, commands, local_routers, resolve
from kvlab.doctor import preflight
from kvlab.errors import ConfigError
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.lab import DEFAULT_TOPOLOGY, _run_dir, _topology, bench_spec
from kvlab.load.measure import Record
from kvlab.load.runner import Progress
from kvlab.load.spec import BenchSpec
from kvlab.load.workloads import NAMES, create
from kvlab.run.command import guarded
from kvlab.run.phases import Display, Phase, RichDisplay, run_phases
from kvlab.stack.state import write_json
from kvlab.tokenizer import Tokenizer
from kvlab.topology import Topology

DEFAULT_ROUTERS = "round-robin,prefix,kv-aware,vllm-router:cache_aware,vllm-router:kv_aware"
PRESET = {"duration": 30.0, "users": 8}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab compare", description=__doc__.splitlines()[0])
    p.add_argument("--routers", default=DEFAULT_ROUTERS,
                   help="comma-separated routers: kvlab presets, vllm-router:<policy>, or names given with --router")
    p.add_argument("--router", action="append", default=[], metavar="NAME=COMMAND",
                   help="another router to start, as a command template: {port} (required), {host}, "
                        "{metrics_port}, {model}, {block_size}; a word with {url}, {kv_events} or {replica} is "
                        "repeated per replica (docs/compare.md). Name it in --routers too.")
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim", help="the replicas (default sim)")
    p.add_argument("--topology", help="labs/topologies name or YAML file (default: quickstart for sim, vllm for vllm)")
    p.add_argument("--replicas", type=int, help="override the number of replicas (single-pool topologies)")
    p.add_argument("--workload", default=None,
                   help="comma-separated workloads, run one after another (default: the topology's): "
                        + ", ".join(NAMES))
    p.add_argument("--workload-params", default="{}", help="JSON object of workload parameters (one workload only)")
    p.add_argument("--duration", type=float, help=f"seconds per router (default {PRESET['duration']:.0f})")
    p.add_argument("--users", type=int, help=f"concurrent Locust users (default {PRESET['users']:.0f})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-requests", type=int, default=0,
                   help="a router also runs until this many requests completed (0: duration only)")
    p.add_argument("--phase-limit", type=float, help="seconds a router may take to reach --min-requests")
    p.add_argument("--run-dir", help="where to write (default: a new runs/<id>)")
    return p


def _specs(args: argparse.Namespace, topology: Topology) -> dict[str, BenchSpec]:
    workloads = [w.strip() for w in (args.workload or topology.workload.name).split(",") if w.strip()]
    if len(workloads) > 1 and args.workload_params.strip() not in {"", "{}"}:
        raise ConfigError("--workload-params applies to one workload; run the others separately")
    for w in workloads:
        if w not in NAMES:
            raise ConfigError(f"unknown workload {w!r}; choose one of: {', '.join(NAMES)}")
    return {w: bench_spec(argparse.Namespace(**{**vars(args), "workload": w}), topology, PRESET) for w in workloads}


class Labelled:
    """The rich progress, each bar named `workload · router`."""

    def __init__(self, display: RichDisplay, label: str) -> None:
        self.display, self.label = display, label

    def begin(self, number: int, phase: Phase, total_s: float) -> Progress:
        return self.display.begin(number, Phase(f"{self.label} · {phase.name}", phase.policy), total_s)

    def end(self) -> None:
        self.display.end()


def measure(stack: RouterStack, spec: BenchSpec, routers: list[Router], out: Path, display: Display,
            tokenizer: PromptTokenizer) -> tuple[list[Row], dict[str, list[Record]], str]:
    """Every router on one workload: (rows, records by router, what the oracle assumed)."""
    block_size, blocks = capacity(stack.base.topology)
    workload = create(spec.workload, seed=spec.seed, params=spec.params)
    replicas = stack.base.replicas
    rows, records = [], {}
    for number, router in enumerate(routers, 1):
        before = request_counts(replicas)
        [result] = run_phases(stack, spec, [Phase(router.name, router.name)], out, display, first=number)
        after = request_counts(replicas)
        ceiling = ceiling_for(workload, result.records, block_size, len(replicas), blocks, tokenizer)
        rows.append(row(router.name, router.peer, result.summary, ceiling, before, after, stack.peer_counters()))
        records[router.name] = result.records
    cap = f"{len(replicas)} × {blocks} blocks of {block_size}" if blocks else f"unbounded, blocks of {block_size}"
    return rows, records, f"oracle: Belady on one pooled cache of {cap}"


def run_compare(argv: list[str], console: Console) -> Path:
    args = parser().parse_args(argv)
    routers = resolve([r.strip() for r in args.routers.split(",") if r.strip()], commands(args.router))
    if not routers:
        raise ConfigError("--routers names no router")
    args.topology = args.topology or DEFAULT_TOPOLOGY[args.engine]
    topology = _topology(args)
    if topology.gateway.autoscale is not None or len(topology.pools) != 1 or topology.pools[0].role != "both":
        raise ConfigError(f"topology {topology.name}: compare needs one pool of whole-request replicas")
    specs = _specs(args, topology)
    doctor = preflight(console, topology.engine)
    run_dir = _run_dir(args, "compare")
    console.rule(f"[bold]kvlab compare[/bold] {run_dir.name}")
    first = next(iter(specs.values()))
    console.print(f"{topology.total_replicas} {topology.engine} replicas · workloads {', '.join(specs)} "
                  f"(seed {first.seed}) · {first.users} users · {first.duration_s:.0f} s per router · "
                  f"routers: {', '.join(r.name for r in routers)}")
    tokenizer = PromptTokenizer(Tokenizer(topology.tokenizer)) if topology.tokenizer else PromptTokenizer()
    started = time.monotonic()
    sections: dict[str, Any] = {}
    records: dict[str, dict[str, list[Record]]] = {}
    with local_routers(console, topology, run_dir, routers, doctor.advice) as stack, \
            RichDisplay(console, waiting="starting router...") as display:
        for w, spec in specs.items():
            rows, records[w], note = measure(stack, spec, routers, run_dir / w, Labelled(display, w), tokenizer)
            sections[w] = {"workload": create(w, seed=spec.seed, params=spec.params).describe(),
                           "oracle_note": note, "routers": [msgspec.to_builtins(r) for r in rows]}
    document = {
        "id": run_dir.name, "run_dir": str(run_dir), "command": "kvlab compare " + shlex.join(argv),
        "engine": topology.engine, "replicas": topology.total_replicas, "topology": msgspec.to_builtins(topology),
        "routers": [r.name for r in routers], "users": first.users, "duration_s": first.duration_s,
        "seed": first.seed, "wall_s": round(time.monotonic() - started, 1),
        "machine": {"isa": doctor.cpu.isa.level, "cores": doctor.cpu.cores},
        "workloads": sections,
    }
    write_json(run_dir / "compare.json", document)
    from kvlab.report.compare import write_compare

    report = write_compare(run_dir / "compare.html", document, records)
    for w, section in sections.items():
        rows = [Row(**r) for r in section["routers"]]
        console.print(table(w, rows, section["oracle_note"]))
        for warning in filter(None, map(kv_path_warning, rows)):
            console.print(f"[yellow]![/yellow] {w} · {warning}")
    console.print(f"report:  {report}\nresults: {run_dir / 'compare.json'}")
    return run_dir


def main(argv: list[str]) -> int:
    console = Console()
    return guarded(console, "compare", lambda: run_compare(argv, console), "every process was stopped")

