"""`run_phases`: the one loop every lab scenario runs (spec → stack → load → results).

For each phase: reset the stack's prefix caches, ask it for a gateway routing with the phase's
policy, run the seeded Locust workload against it into <run>/phase-N-<name>/, and keep the
summary and the records. `kvlab lab`, the cluster lab, the autoscale scenario and the notebooks
are drivers of this loop; how progress is shown (rich in a terminal, HTML in a notebook) is the
`Display` they pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import msgspec
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvlab.load.measure import Record, read_records
from kvlab.load.runner import Progress as Watch
from kvlab.load.runner import run_bench
from kvlab.load.spec import BenchSpec
from kvlab.load.summary import Summary
from kvlab.stack.base import Stack


class Phase(msgspec.Struct, frozen=True):
    """One phase: `name` labels its directory and records; `policy` is what the gateway routes with
    (a cluster's baseline phase names kube-proxy's spreading); `fresh`: a new gateway for it."""

    name: str
    policy: str
    fresh: bool = True
    entry: str | None = None   # which front door of a stack with several (a cluster: baseline, gateway-api, ...)


class PhaseResult(msgspec.Struct, kw_only=True):
    """What a phase produced: its summary.json and its requests.jsonl records."""

    phase: Phase
    dir: Path
    summary: Summary
    records: list[Record]
    resets: dict[str, str | None] = msgspec.field(default_factory=dict)   # replica -> why a reset failed
    autoscale: dict[str, Any] | None = None   # the autoscale scenario's timeline (report/autoscale.py)


class Display(Protocol):
    """How a driver shows a phase running."""

    def begin(self, number: int, phase: Phase, total_s: float) -> Watch: ...

    def end(self) -> None: ...


def live_line(records: list[Record]) -> str:
    """Requests so far, TTFT p50 and errors: the live part of a progress line."""
    ok = [r.ttft_ms for r in records if not r.error and r.ttft_ms is not None]
    errors = sum(1 for r in records if r.error)
    p50 = f"{np.percentile(ok, 50):.0f} ms" if ok else "–"
    return f"{len(records)} requests, TTFT p50 {p50}, {errors} errors"


class RichDisplay:
    """A rich progress bar per phase in the terminal; `live` renders the text beside it."""

    def __init__(self, console: Console, waiting: str = "", live: Callable[[float, list[Record]], str]
                 | None = None) -> None:
        self.waiting = waiting
        self.live = live or (lambda _elapsed, records: live_line(records))
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24), TimeElapsedColumn(),
                                 TextColumn("{task.fields[live]}"), console=console)

    def __enter__(self) -> RichDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def begin(self, number: int, phase: Phase, total_s: float) -> Watch:
        task = self.progress.add_task(f"phase {number}: {phase.name}", total=total_s, live=self.waiting)

        def update(elapsed: float, records: list[Record]) -> None:
            self.progress.update(task, completed=min(elapsed, total_s), live=self.live(elapsed, records))

        return update

    def end(self) -> None:
        for task in self.progress.tasks:
            self.progress.update(task.id, completed=task.total)


def run_phases(stack: Stack, spec: BenchSpec, phases: list[Phase], run_dir: Path, display: Display,
               first: int = 1, until: Callable[[list[Record]], bool] | None = None) -> list[PhaseResult]:
    """Run `phases` in order on `stack` into run_dir/phase-N-<name>/ (N from `first`); `until`: a
    phase also runs until it holds for its records (run_bench)."""
    out: list[PhaseResult] = []
    total_s = spec.ramp.duration_s if spec.ramp is not None else spec.duration_s
    for number, phase in enumerate(phases, first):
        watch = display.begin(number, phase, total_s)
        resets = stack.reset_caches()
        target = stack.gateway_for(phase.policy, fresh=phase.fresh, entry=phase.entry)
        phase_dir = run_dir / f"phase-{number}-{phase.name}"
        summary = run_bench(target, phase_dir, spec, phase=phase.name, policy=phase.policy,
                            otlp_endpoint=stack.otlp_endpoint, progress=watch, until=until)
        display.end()
        out.append(PhaseResult(phase=phase, dir=phase_dir, summary=summary,
                               records=read_records(phase_dir / "requests.jsonl"), resets=resets))
    return out
