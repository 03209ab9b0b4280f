"""`kvlab up`, `kvlab status`, `kvlab down`: the local stack from a topology, detached.

`up` starts a supervisor process (kvlab.stack.supervisor) in its own session and returns once the
stack is healthy, printing where everything is; `down` stops it (and, should the supervisor be
gone, every process stack.json records, after checking each pid still runs that command).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvlab.doctor import preflight
from kvlab.errors import KvlabError
from kvlab.lifecycle import http_ok, terminate
from kvlab.process import Child, log_tail, still_running, stop_recorded
from kvlab.stack.base import StackInfo, read_info
from kvlab.stack.state import new_run_dir, runs_dir, set_latest
from kvlab.topology import load_topology, resolve_topology

MULTI_COMMAND = True
console = Console()


def _run_dir(arg: str | None) -> Path:
    return Path(arg).absolute() if arg else runs_dir() / "latest"


def up(args: argparse.Namespace) -> int:
    topo_path = resolve_topology(args.topology)
    topology = load_topology(topo_path)  # validate before starting anything
    preflight(console, topology.engine)
    run_dir = Path(args.run_dir).absolute() if args.run_dir else new_run_dir(topology.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    set_latest(run_dir)
    argv = [sys.executable, "-m", "kvlab.stack.supervisor", "--run-dir", str(run_dir), "--topology", str(topo_path)]
    log = run_dir / "supervisor.log"
    proc = Child.start("supervisor", argv, log, die_with_parent=False).popen   # outlives `kvlab up`
    deadline = time.monotonic() + args.timeout
    with console.status(f"starting {topology.total_replicas} {topology.engine} replicas and the gateway..."):
        while time.monotonic() < deadline:
            stack = read_info(run_dir)
            if stack and stack.status == "running" and stack.supervisor and stack.supervisor.pid == proc.pid:
                break
            if proc.poll() is not None:
                console.print(f"[red]kvlab up failed[/red] (see {log}):\n{log_tail(log)}")
                return 1
            time.sleep(0.2)
        else:
            console.print(f"[red]kvlab up: not ready after {args.timeout:.0f} s[/red]; stopping (see {log})")
            terminate(proc, 30)
            return 1
    _print_stack(stack)
    console.print("\nnext: [bold]kvlab bench[/bold] | [bold]locust -f labs/locustfile.py[/bold] | [bold]kvlab down[/bold]")
    return 0


def _print_stack(stack: StackInfo) -> None:
    console.print(f"[bold]stack {stack.id}[/bold] ({stack.status}), run dir {stack.run_dir}")
    console.print(f"  gateway     {stack.gateway}  policy {stack.policy}")
    for r in stack.replicas:
        console.print(f"  replica     {r.name:<10} {r.url}  kv-events {r.kv_events}")
    console.print(f"  traces      {stack.traces_dir or stack.otlp_endpoint or 'off'}")
    console.print(f"  prometheus  {stack.prometheus or 'off (no prometheus binary)'}")


def status(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args.run_dir)
    stack = read_info(run_dir)
    if stack is None:
        console.print(f"no stack at {run_dir}")
        return 1
    _print_stack(stack)
    table = Table("process", "pid", "alive", "log")
    for p in stack.processes:
        alive = still_running(p)
        table.add_row(p.name, str(p.pid), "[green]yes[/green]" if alive else "[red]no[/red]", p.log)
    console.print(table)
    health = Table("endpoint", "url", "health")
    for name, url in [("gateway", stack.gateway or ""), *[(r.name, r.url) for r in stack.replicas]]:
        health.add_row(name, url, "[green]ok[/green]" if http_ok(f"{url}/health") else "[red]down[/red]")
    console.print(health)
    return 0 if stack.status == "running" else 1


def down(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args.run_dir)
    stack = read_info(run_dir)
    if stack is None:
        console.print(f"no stack at {run_dir}")
        return 0
    stopped = 0
    if stack.supervisor and stop_recorded(stack.supervisor, grace_s=60):
        stopped += 1
    for p in reversed(stack.processes):  # leftovers if the supervisor was killed
        stopped += stop_recorded(p)
    console.print(f"stack {stack.id} stopped ({stopped} process{'es' if stopped != 1 else ''} signalled)")
    return 0


# what each command does (its --help)
DESCRIPTIONS = {
    "up": "Start a local stack (replicas, gateway, telemetry) from a topology, detached; its processes go to "
          "the run's stack.json.",
    "status": "Show the local stack's processes (those in stack.json) and their health.",
    "down": "Stop the local stack: every process stack.json records, peers and leftovers included.",
}


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"kvlab {command}", description=DESCRIPTIONS[command])
    p.add_argument("--run-dir", help="the run directory (default: a new one for up, runs/latest otherwise)")
    if command == "up":
        p.add_argument("--topology", default="quickstart", help="a labs/topologies name or a YAML file")
        p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for health")
    return p


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    args = parser(command).parse_args(rest)
    try:
        return {"up": up, "status": status, "down": down}[command](args)
    except KvlabError as exc:
        console.print(f"kvlab {command}: {exc}", style="red", markup=False)
        return 2
