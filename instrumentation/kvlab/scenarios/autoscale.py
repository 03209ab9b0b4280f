"""The ramping-load autoscaling scenario: `kvlab lab --topology autoscale`.

Runs when the topology sets `gateway.autoscale` (labs/topologies/autoscale.yaml). One phase: the
replicas start, the gateway watches the endpoints file (`--discovery file`) and publishes its
desired-replica recommendation, the stack's Scaler acts on it, and Locust ramps the users up,
holds, drops and idles (`kvlab.load.ramp.up_hold_down`). Every half second the scenario samples the
recommendation and the running replicas, so the report can show load rising, the recommendation,
the scale-up, its effect on TTFT and the scale-down on one time axis; the scale actions are
`stack.scale` spans in the run's traces and Prometheus follows the replicas through file_sd.
Writes phase-1-<policy>/{requests.jsonl, summary.json, autoscale.json}, summary.json, report.html.
"""

from __future__ import annotations

import csv
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from kvlab.load.measure import Record
from kvlab.load.ramp import Ramp, up_hold_down
from kvlab.load.spec import BenchSpec
from kvlab.load.table import summary_table
from kvlab.load.workloads import create
from kvlab.report import write_report
from kvlab.run.document import RunDocument, write_run
from kvlab.run.phases import Phase, RichDisplay, run_phases
from kvlab.run.presets import AUTOSCALE, AUTOSCALE_QUICK
from kvlab.scenarios.sampler import Sampler
from kvlab.stack.local import LocalStack
from kvlab.stack.state import new_run_dir, write_json
from kvlab.topology import Topology

SETTLE_S = 10.0     # after the ramp, wait at most the scale-down window + this for the floor


class Timeline(Sampler):
    """Samples `GET /debug/autoscale` and the running replicas every `interval_s` in a thread."""

    def __init__(self, gateway_url: str, running: Callable[[], int], interval_s: float = 0.5) -> None:
        super().__init__(interval_s, "kvlab-autoscale-timeline")
        self.url = f"{gateway_url.rstrip('/')}/debug/autoscale"
        self.running = running

    def tick(self) -> None:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as resp:
                rec = json.loads(resp.read()).get("recommendation")
            running = self.running()
        except (OSError, ValueError):
            return
        if rec:
            self.samples.append({"t": time.time(), "running": running, **rec})

    @property
    def last(self) -> dict[str, Any]:
        return self.samples[-1] if self.samples else {}


def users_over_time(phase_dir: Path) -> list[tuple[float, int]]:
    """(unix time, Locust users) from Locust's stats history (one row per second)."""
    rows: dict[float, int] = {}
    try:
        with open(phase_dir / "locust_stats_history.csv", newline="") as f:
            for row in csv.DictReader(f):
                rows[float(row["Timestamp"])] = int(row["User Count"])
    except (OSError, KeyError, ValueError):
        return []
    return sorted(rows.items())


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def summarize_autoscale(samples: list[dict[str, Any]], actions: list[dict[str, Any]],
                        records: list[Record], ramp: Ramp) -> dict[str, Any]:
    """What the run shows: the recommendation's path, the actions, TTFT by running replicas and
    at peak load (requests sent while the ramp was at its peak; time 0 = the first request)."""
    desired = [s["desired"] for s in samples]
    peak = max(desired) if desired else None
    peak_i = desired.index(peak) if desired else 0
    times = [s["t"] for s in samples]
    by_running: dict[int, list[float]] = {}
    measured = [(r.ts, r.ttft_ms) for r in records if not r.error and r.ttft_ms is not None]
    for ts, ttft in measured:
        if not times:
            break
        i = int(np.searchsorted(times, ts, side="right")) - 1
        by_running.setdefault(samples[max(i, 0)]["running"], []).append(ttft)
    t0 = min((r.ts for r in records), default=0.0)
    loaded = [ttft for ts, ttft in measured if ramp.users_at(ts - t0) == ramp.peak]
    return {
        "desired_first": desired[0] if desired else None,
        "desired_peak": peak,
        "desired_last": desired[-1] if desired else None,
        "desired_fell_after_peak": bool(desired) and min(desired[peak_i:]) < peak,
        "running_max": max((s["running"] for s in samples), default=None),
        "scale_ups": sum(a["direction"] == "up" for a in actions),
        "scale_downs": sum(a["direction"] == "down" for a in actions),
        "scale_up_ready_ms": [a["ready_ms"] for a in actions if a["direction"] == "up"],
        "reasons": sorted({s["reason"] for s in samples}),
        "ttft_at_peak_users": {"requests": len(loaded), "p50": _pct(loaded, 50), "p95": _pct(loaded, 95)},
        "ttft_by_running_replicas": {
            str(n): {"requests": len(v), "p50": _pct(v, 50), "p95": _pct(v, 95)}
            for n, v in sorted(by_running.items())},
    }


def _actions_table(actions: list[dict[str, Any]], t0: float) -> Table:
    table = Table("t (s)", "action", "replica", "replicas after", "reason", "took (ms)", title="scaling actions")
    for a in actions:
        table.add_row(f"{a['t'] - t0:.1f}", a["direction"], a["replica"], str(a["to"]), a["reason"],
                      f"{a['ready_ms']:.0f}")
    return table


def run_autoscale(topology: Topology, spec: BenchSpec, console: Console, policy: str, *, quick: bool = False,
                  duration_s: float | None = None, users: int | None = None, run_dir: Path | None = None) -> Path:
    """The scenario (see the module docstring) with `spec`'s workload, the ramp sized by `duration_s`
    and peak `users` (defaults: AUTOSCALE, or AUTOSCALE_QUICK); returns the run dir."""
    preset = AUTOSCALE_QUICK if quick else AUTOSCALE
    ramp = up_hold_down(duration_s or preset.duration_s, users or preset.users)
    spec = msgspec.structs.replace(spec, ramp=ramp, users=ramp.peak, duration_s=ramp.duration_s,
                                   min_requests=0, limit_s=None)
    settings = topology.gateway.autoscale
    assert settings is not None
    run_dir = run_dir.absolute() if run_dir else new_run_dir("autoscale")
    console.rule(f"[bold]kvlab lab · autoscaling[/bold] {run_dir.name}")
    console.print(f"{topology.total_replicas} {topology.engine} replica(s) to start, up to {settings.max_replicas} · "
                  f"policy {policy} · workload {spec.workload} (seed {spec.seed}) · users 1 → {ramp.peak} → 1 "
                  f"over {ramp.duration_s:.0f} s")
    started = time.monotonic()
    with LocalStack(topology, run_dir, policy=policy) as stack:
        with console.status("starting replicas, gateway, telemetry and the scaler..."):
            stack.start()
        scaler = stack.scaler
        assert scaler is not None
        floor = scaler.current()
        timeline = Timeline(stack.gateway_url, scaler.current).start()
        console.print(f"[green]✓[/green] up in {time.monotonic() - started:.0f} s; logs in {stack.logs}")

        def live(elapsed: float, records: list[Record]) -> str:
            s = timeline.last
            return (f"users {ramp.users_at(elapsed) or 0:>2} · desired {s.get('desired', '–')} "
                    f"({s.get('reason', '')}) · running {s.get('running', '–')} · {len(records)} requests")

        try:
            with RichDisplay(console, live=live) as display:   # one phase, on the gateway the scaler follows
                (ran,) = run_phases(stack, spec, [Phase(policy, policy, fresh=False)], run_dir, display)
            with console.status("load over: waiting for the scale-down..."):
                deadline = time.monotonic() + settings.scale_down_window_s + SETTLE_S
                while time.monotonic() < deadline and scaler.current() > floor:
                    time.sleep(0.5)
                time.sleep(1.0)   # one more sample at the floor
        finally:
            timeline.stop()
            actions = list(scaler.actions)
            stack.stop_scaler()
    out, summary = ran.dir, ran.summary
    records = ran.records
    data = {"ramp": msgspec.to_builtins(ramp), "settings": msgspec.to_builtins(settings), "floor": floor,
            "samples": timeline.samples, "actions": actions, "users": users_over_time(out)}
    write_json(out / "autoscale.json", data)
    result = summarize_autoscale(timeline.samples, actions, records, ramp)
    write_run(run_dir / "summary.json", RunDocument(
        id=run_dir.name, run_dir=str(run_dir), scenario="autoscale", engine=topology.engine,
        replicas=topology.total_replicas, topology=msgspec.to_builtins(topology),
        workload=create(spec.workload, seed=spec.seed, params=spec.params).describe(), users=ramp.peak,
        duration_s=ramp.duration_s, quick=quick,
        policies=[policy], phases={policy: summary}, autoscale=result,
        wall_s=round(time.monotonic() - started, 1),
    ))
    meta = {"run": run_dir.name, "scenario": "autoscaling under a load ramp", "engine": topology.engine,
            "replicas at start": topology.total_replicas, "workload": spec.workload, "seed": spec.seed,
            "peak users": ramp.peak, "seconds": ramp.duration_s}
    report = write_report(run_dir / "report.html", {policy: msgspec.structs.replace(ran, autoscale=data)}, meta)
    console.print(summary_table({policy: summary}, title="the run"))
    t0 = min((r.ts for r in records), default=time.time())
    console.print(_actions_table(actions, t0))
    peak = result["ttft_at_peak_users"]
    ttft = " · ".join([f"at peak load: TTFT p50 {peak['p50']} ms, p95 {peak['p95']} ms ({peak['requests']} req)"]
                      + [f"{n} running: TTFT p50 {v['p50']} ms ({v['requests']} req)"
                         for n, v in result["ttft_by_running_replicas"].items()])
    console.print(f"[bold]desired {result['desired_first']} → {result['desired_peak']} → {result['desired_last']}; "
                  f"{result['scale_ups']} scale-up(s), {result['scale_downs']} scale-down(s)[/bold]\n{ttft}")
    console.print(f"report:  {report}\nsummary: {run_dir / 'summary.json'}\ntraces:  "
                  f"{stack.traces_dir or stack.otlp_endpoint or 'off'}  (stack.scale and gateway.autoscale spans)")
    return run_dir
