"""A replica SIGKILLed under streaming load and restarted: `kvlab lab --topology faults` and lab 11.

`Outage` watches the gateway while a phase runs. Once the gateway has answered `after_requests`
requests, at the first sample where the replica is running requests (its vLLM
`num_requests_running`: a kill between two streams would resume none), it SIGKILLs the process
group of one pool's engine (for vLLM the API server and its engine core), then waits for the
replica to answer /health again: restarted by `kvlab up`'s supervisor, or by the same `Restarter`
when the stack runs in this process (`kvlab lab`). Every `interval_s` it samples the gateway's
requests and resumes (`kvlab_gateway_resumes_total`) and whether the replica is up. `done` ends
the phase `after_restart` requests after the return, so a busy machine lengthens the phase
instead of cutting the story short. The streams that broke are resumed on the surviving replica
by the gateway (gateway/resume.py, docs/reliability.md).
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from kvlab.contract import Endpoint
from kvlab.load.measure import Record
from kvlab.load.spec import BenchSpec
from kvlab.load.table import summary_table
from kvlab.load.workloads import create
from kvlab.report import write_report
from kvlab.run.document import RunDocument, write_run
from kvlab.run.phases import Phase, RichDisplay, run_phases
from kvlab.run.presets import OUTAGE, OUTAGE_QUICK
from kvlab.scenarios.faults import scrape
from kvlab.scenarios.sampler import Sampler
from kvlab.stack.base import read_info
from kvlab.stack.local import LocalStack
from kvlab.stack.state import new_run_dir, write_json
from kvlab.stack.supervisor import Restarter
from kvlab.telemetry import names
from kvlab.topology import FaultSettings, Topology

LIMIT_S = 120.0     # the phase's default limit: a busy machine restarts the replica slowly
_REQUESTS = re.compile(rf"^{names.KVLAB_REQUESTS}_total\{{.*\}} (\S+)$", re.M)
_RESUMES = re.compile(rf'^{names.KVLAB_RESUMES}_total\{{.*?reason="([^"]*)".*?\}} (\S+)$', re.M)


def pool_replica(run_dir: Path, pool: str) -> Endpoint:
    """The (first) replica of `pool` from its engine's ready JSON in the run dir."""
    ready = msgspec.json.decode((Path(run_dir) / f"ready-{pool}.json").read_bytes(), type=dict[str, list[Endpoint]])
    return ready["replicas"][0]


def recorded_pid(run_dir: Path, pool: str) -> int:
    """The pid of `pool`'s engine as stack.json records it (`kvlab up`: the supervisor's child)."""
    stack = read_info(Path(run_dir))
    return next(p.pid for p in (stack.processes if stack else []) if p.name == f"engine-{pool}")


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            text: str = resp.read().decode()
            return text
    except OSError:
        return None


class Outage(Sampler):
    """Kill one replica once the gateway has answered `after_requests`, watch it come back (above)."""

    def __init__(self, gateway_url: str, replica: Endpoint, pid: Callable[[], int], *, after_requests: int = 30,
                 after_restart: int = 60, restart: Callable[[], None] | None = None, interval_s: float = 0.2) -> None:
        self.gateway_url, self.replica, self.pid, self.restart = gateway_url.rstrip("/"), replica, pid, restart
        super().__init__(interval_s, "kvlab-outage")
        self.after_requests, self.after_restart = after_requests, after_restart
        self.killed_at: float | None = None     # unix times
        self.back_at: float | None = None
        self.killed_pid: int | None = None
        self._seen_down = False
        self._base: float | None = None

    def tick(self) -> None:
        now = time.time()
        metrics = _get(self.gateway_url + "/metrics") or ""
        requests = sum(float(v) for v in _REQUESTS.findall(metrics))
        resumes = {r: float(v) for r, v in _RESUMES.findall(metrics)}
        up = _get(self.replica.url + "/health") is not None
        if self._base is None:
            self._base = requests
        if self.killed_at is None and requests - self._base >= self.after_requests and self._serving():
            self.killed_pid = self.pid()
            os.killpg(self.killed_pid, signal.SIGKILL)   # the engine and whatever it started
            self.killed_at, up = now, False
        elif self.killed_at is not None and self.back_at is None:
            if self.restart is not None:
                self.restart()
            self._seen_down |= not up
            if up and self._seen_down:
                self.back_at = now
        self.samples.append({"t": now, "requests": requests, "resumes": sum(resumes.values()),
                             "resumes_by_reason": resumes, "up": up})

    def _serving(self) -> bool:
        """Whether the replica is running requests now (its own vLLM metrics)."""
        try:
            return scrape(self.replica.url, names.VLLM_NUM_REQUESTS_RUNNING) > 0
        except (OSError, ValueError):
            return False

    def done(self, records: list[Record]) -> bool:
        """Whether `after_restart` requests were sent since the replica came back."""
        return self.back_at is not None and sum(1 for r in records if r.ts >= self.back_at) >= self.after_restart

    def in_flight_at_kill(self, records: list[Record]) -> list[Record]:
        """The requests the killed replica was serving when it died (the resumed ones)."""
        k = self.killed_at
        return [r for r in records if k is not None and r.replica == self.replica.name
                and r.ts <= k <= r.ts + r.e2e_ms / 1000]

    def result(self, records: list[Record]) -> dict[str, Any]:
        """What the run shows: failed requests, resumes by reason, the replica's time down, the
        resumed requests' TTFT and worst token gap against everyone else's."""
        last = self.samples[-1] if self.samples else {}
        hit = self.in_flight_at_kill(records)
        back = [r for r in records if self.back_at is not None and r.ts >= self.back_at
                and r.replica == self.replica.name and not r.error]
        prompt, cached = sum(r.prompt_tokens or 0 for r in back), sum(r.cached_tokens or 0 for r in back)
        ids = {id(r) for r in hit}
        def stall(rs: list[Record], q: float = 0.5) -> float | None:
            worst = sorted(max(r.ttft_ms or 0.0, r.itl_max_ms or 0.0) for r in rs if not r.error)
            return round(worst[min(int(len(worst) * q), len(worst) - 1)], 1) if worst else None
        return {"replica": self.replica.name, "killed_pid": self.killed_pid, "killed_at": self.killed_at,
                "back_at": self.back_at,
                "down_s": round(self.back_at - self.killed_at, 2) if self.back_at and self.killed_at else None,
                "requests": len(records), "failed": sum(1 for r in records if r.error),
                "resumes": int(last.get("resumes", 0)), "resumes_by_reason": last.get("resumes_by_reason", {}),
                "in_flight_at_kill": len(hit),
                "after_restart_on_replica": len(back),
                "hit_rate_after_restart": round(cached / prompt, 3) if prompt else None,
                "stall_ms_p50_in_flight": stall(hit), "stall_ms_max_in_flight": stall(hit, 1.0),
                "stall_ms_p50_others": stall([r for r in records if id(r) not in ids])}


    def save(self, out: Path, records: list[Record]) -> dict[str, Any]:
        """result() written to `out` (a phase folder's outage.json) with the samples; returns it."""
        result = self.result(records)
        write_json(Path(out) / "outage.json", {**result, "samples": self.samples})
        return result


def hit_rate_over_time(records: list[Record], t0: float, bin_s: float = 1.0) -> dict[str, list[tuple[float, float]]]:
    """Per replica, the delivered prefix-cache hit rate (cached / prompt tokens) of the requests
    sent in each `bin_s` bin, the bins' starts counted from `t0`."""
    bins: dict[str, dict[float, list[int]]] = {}
    for r in records:
        if r.error or not r.replica or not r.prompt_tokens:
            continue
        b = (r.ts - t0) // bin_s * bin_s
        acc = bins.setdefault(r.replica, {}).setdefault(b, [0, 0])
        acc[0] += r.cached_tokens or 0
        acc[1] += r.prompt_tokens
    return {rep: [(b, c / p) for b, (c, p) in sorted(v.items())] for rep, v in sorted(bins.items())}


def run_outage(topology: Topology, spec: BenchSpec, console: Console, policy: str, *, quick: bool = False,
               duration_s: float | None = None, users: int | None = None, run_dir: Path | None = None) -> Path:
    """The scenario (see the module docstring) on a local stack of `topology` (its `faults:`),
    one phase of `spec`'s workload (at most `spec.limit_s`, default LIMIT_S); writes the usual run
    outputs plus phase-1-<policy>/outage.json."""
    faults: FaultSettings | None = topology.faults
    assert faults is not None
    preset = OUTAGE_QUICK if quick else OUTAGE
    spec = msgspec.structs.replace(spec, duration_s=duration_s or preset.duration_s,
                                   users=users or preset.users, min_requests=0,
                                   limit_s=spec.limit_s or LIMIT_S)
    run_dir = run_dir.absolute() if run_dir else new_run_dir("faults")
    console.rule(f"[bold]kvlab lab · a replica lost under load[/bold] {run_dir.name}")
    console.print(f"{topology.total_replicas} {topology.engine} replicas · policy {policy} · workload {spec.workload} "
                  f"(seed {spec.seed}) · {spec.users} users · pool {faults.kill} SIGKILLed after "
                  f"{faults.after_requests} requests, the phase ends {faults.after_restart} requests after its restart")
    started = time.monotonic()
    with LocalStack(topology, run_dir, policy=policy) as stack:
        with console.status("starting replicas, gateway and telemetry..."):
            stack.start()
        victim = next(c for c in stack.children if c.name == f"engine-{faults.kill}")
        outage = Outage(stack.gateway_url, pool_replica(run_dir, faults.kill),
                        lambda: next(c for c in stack.children if c.name == victim.name).pid,
                        after_requests=faults.after_requests, after_restart=faults.after_restart,
                        restart=Restarter(stack).check)

        def live(_elapsed: float, records: list[Record]) -> str:
            s = outage.samples[-1] if outage.samples else {}
            state = ("up" if outage.killed_at is None else "killed" if outage.back_at is None else "restarted")
            return (f"{len(records)} requests, {sum(1 for r in records if r.error)} failed · {faults.kill} {state} · "
                    f"{s.get('resumes', 0):.0f} resumes")

        with outage, RichDisplay(console, live=live) as display:
            (ran,) = run_phases(stack, spec, [Phase(policy, policy, fresh=False)], run_dir, display, until=outage.done)
    result = outage.save(ran.dir, ran.records)
    write_run(run_dir / "summary.json", RunDocument(
        id=run_dir.name, run_dir=str(run_dir), scenario="faults", engine=topology.engine,
        replicas=topology.total_replicas, topology=msgspec.to_builtins(topology),
        workload=create(spec.workload, seed=spec.seed, params=spec.params).describe(), users=spec.users,
        duration_s=spec.duration_s, quick=quick, policies=[policy],
        phases={policy: ran.summary}, outage=result,
        wall_s=round(time.monotonic() - started, 1),
    ))
    meta = {"run": run_dir.name, "scenario": "a replica SIGKILLed under load and restarted", "engine": topology.engine,
            "replicas": topology.total_replicas, "workload": spec.workload, "seed": spec.seed, "users": spec.users}
    report = write_report(run_dir / "report.html", {policy: ran}, meta)
    console.print(summary_table({policy: ran.summary}, title="the run"))
    down = f"down {result['down_s']} s" if result["down_s"] is not None else "[red]not back within the phase[/red]"
    console.print(f"[bold]{result['failed']} of {result['requests']} requests failed; {result['resumes']} resumed "
                  f"on another replica ({result['in_flight_at_kill']} were on {result['replica']} when it was killed); "
                  f"{result['replica']} {down}, then served {result['after_restart_on_replica']} requests "
                  f"(delivered hit rate {result['hit_rate_after_restart'] or 0:.0%})[/bold]\n"
                  f"resumed requests' TTFT or worst token gap, p50: {result['stall_ms_p50_in_flight']} ms "
                  f"(the others: {result['stall_ms_p50_others']} ms)")
    console.print(f"report:  {report}\nsummary: {run_dir / 'summary.json'}\ntraces:  "
                  f"{stack.traces_dir or stack.otlp_endpoint or 'off'}  "
                  f"(`kvlab traces explain --resumed --run {run_dir}`)")
    return run_dir
