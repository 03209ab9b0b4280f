"""One twin run per policy, from settings to summaries: the part `kvlab twin`, the benchmark, the
tests and the lab share."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvlab.load.measure import Record
from kvlab.load.oracle import Oracle, ceiling
from kvlab.load.stages import results
from kvlab.load.summary import Slo, Summary, open_loop, summarize
from kvlab.twin.cluster import Cluster, Outcome
from kvlab.twin.feed import Feed
from kvlab.twin.settings import Plan, TwinSettings, resolve


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


def run(plan: Plan, oracle: bool = True, feed: Feed | None = None,
        progress: Callable[[int], None] | None = None) -> TwinResult:
    """Run one plan to its end."""
    start = time.perf_counter()
    cluster = Cluster(plan, feed, keep_keys=oracle)
    outcome = cluster.run(progress)
    wall = time.perf_counter() - start
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
