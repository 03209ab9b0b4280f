"""One twin run per policy, from settings to summaries: the part `kvlab twin`, the benchmark, the
tests and the lab share."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvlab.errors import TwinError
from kvlab.load.measure import Record
from kvlab.load.oracle import Oracle, ceiling
from kvlab.load.stages import results
from kvlab.load.summary import Slo, Summary, open_loop, summarize
from kvlab.twin.cluster import Cluster, Outcome
from kvlab.twin.feed import Feed
from kvlab.twin.settings import Plan, TwinSettings, resolve
from kvlab.twin.workers import REPORT_EVERY_S, Interrupt, Report, side_by_side

Progress = Callable[[int, float], None]   # (requests done, virtual seconds)


@dataclass(slots=True)
class TwinResult:
    """One policy's run: its summary.json, its records, the oracle and how long it took."""

    plan: Plan
    summary: Summary
    records: list[Record]
    outcome: Outcome
    oracle: Oracle | None
    wall_s: float

    @property
    def speedup(self) -> float:
        """Virtual seconds simulated per wall-clock second."""
        return self.outcome.virtual_s / self.wall_s if self.wall_s > 0 else 0.0


def plans(settings: TwinSettings, policies: list[str]) -> list[Plan]:
    """One checked plan per policy (all are checked before any runs)."""
    if not policies:
        return [resolve(settings)]
    out = [resolve(msgspec.structs.replace(settings, policy=p)) for p in policies]
    # one workload object: its texts (and a trace's parsed rows) are made once for every policy
    return [dataclasses.replace(p, workload=out[0].workload) for p in out]


class Stopped(Exception):
    """A run ended early (Ctrl-C, SIGTERM, the watchdog): `result` holds what had finished, its
    summary marked partial; `why` says what stopped it."""

    def __init__(self, result: TwinResult, why: str) -> None:
        super().__init__(why)
        self.result = result
        self.why = why


def run(plan: Plan, oracle: bool = True, feed: Feed | None = None, progress: Progress | None = None) -> TwinResult:
    """Run one plan to its end, `progress(requests done, virtual seconds)` as each finishes;
    `Stopped` (with what had finished) when it is interrupted or its watchdog fires."""
    start = time.perf_counter()
    cluster = Cluster(plan, feed, keep_keys=oracle)
    try:
        outcome = cluster.run(None if progress is None else lambda n: progress(n, cluster.now_ms / 1000.0))
    except (KeyboardInterrupt, Interrupt, TwinError) as exc:
        why = str(exc) if isinstance(exc, TwinError) else f"stopped by {type(exc).__name__}"
        result = _result(plan, cluster, cluster.outcome(), time.perf_counter() - start)
        result.summary.partial = True
        raise Stopped(result, why) from exc
    return _result(plan, cluster, outcome, time.perf_counter() - start)


def _result(plan: Plan, cluster: Cluster, outcome: Outcome, wall: float) -> TwinResult:
    records = sorted(outcome.records, key=lambda r: r.ts)
    s = plan.settings
    summary = summarize(records, Slo())
    if plan.users is None:
        offered = plan.arrival.rate if plan.arrival is not None else len(records) / max(outcome.virtual_s, 1e-9)
        label = plan.arrival.label if plan.arrival is not None else "stages" if plan.stages else "trace"
        summary.open_loop = open_loop(records, offered, label, s.time_scale if plan.trace_timing else None,
                                      summary.duration_s)
    summary.phase = summary.policy = plan.policy.name
    summary.target = "twin"
    summary.users = plan.users
    summary.seed = s.seed
    summary.workload = plan.workload.name
    summary.workload_params = msgspec.to_builtins(plan.workload.params)
    summary.configured_duration_s = s.duration_s
    if plan.stages:
        summary.stages = results(records, plan.stages, cluster.samples)
    ceil = None
    if cluster.sent is not None:
        ceil = ceiling(cluster.sent, plan.sim.block_size, plan.replicas * plan.num_blocks)
    return TwinResult(plan, summary, records, outcome, ceil, wall)


@dataclass(slots=True)
class Runs:
    """Every plan's result that ran, in plan order (a stopped run's part, its summary marked partial),
    and why the runs ended early (None: every one finished)."""

    results: list[TwinResult] = field(default_factory=list)
    why: str | None = None
    cause: BaseException | None = None   # KeyboardInterrupt, Interrupt (SIGTERM) or TwinError


def run_all(plans: Sequence[Plan], oracle: bool, progress: Callable[[Plan], Progress], jobs: int) -> Runs:
    """Run every plan, `jobs` at a time side by side (twin/workers.py; 1: one after another in this
    process), `progress(plan)` making a plan's progress callback as it starts. After a stop (a
    signal, a watchdog) no further plan starts; Ctrl-C or SIGTERM stops the ones running too."""
    if not plans:
        return Runs()
    if any(p.workload is not plans[0].workload for p in plans):
        raise ValueError("run_all's plans share one workload object (`plans` makes them so)")
    # one feed for all: the tokenizer loads once, before any fork
    feed = Feed(plans[0].workload)
    updates: dict[int, Progress] = {}
    results: dict[int, TwinResult] = {}
    out = Runs()
    home = os.getpid()

    def work(plan: Plan, report: Report) -> tuple[Any, ...]:
        last = [0.0]
        # in this process every request reaches the bar (it throttles itself); from a forked one,
        # through its pipe, a report every REPORT_EVERY_S
        every = 0.0 if os.getpid() == home else REPORT_EVERY_S

        def reported(n: int, virtual_s: float) -> None:
            now = time.monotonic()
            if now - last[0] >= every:
                last[0] = now
                report((n, virtual_s))
        try:
            return "done", _parts(run(plan, oracle=oracle, feed=feed, progress=reported))
        except Stopped as exc:   # a signal (KeyboardInterrupt, Interrupt) or the watchdog (TwinError)
            return "stopped", _parts(exc.result), exc.why, exc.__cause__

    def update(i: int, what: tuple[int, float]) -> None:
        if i not in updates:
            updates[i] = progress(plans[i])
        updates[i](*what)

    def finished(i: int, value: tuple[Any, ...]) -> bool:
        results[i] = result = TwinResult(plans[i], *value[1])
        update(i, (len(result.records), result.outcome.virtual_s))
        if value[0] == "done":
            return True
        if out.why is None:
            out.why, out.cause = value[2], value[3]
        return False

    ended = side_by_side(plans, work, update, jobs, finished, label=lambda plan: plan.policy.name)
    out.results = [results[i] for i in sorted(ended.values)]
    early = ended.cut_short(lambda i: plans[i].policy.name)
    if early is not None and (ended.signal is not None or out.why is None):   # a signal outranks a watchdog's stop
        out.why, out.cause = early
    return out


def _parts(r: TwinResult) -> tuple[Any, ...]:
    """A result less its plan (the process that asked has it)."""
    return r.summary, r.records, r.outcome, r.oracle, r.wall_s
