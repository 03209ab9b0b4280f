"""Dynamo's own router and mocker engine, replayed on the twin's trace: a second, independent
simulator beside the twin (docs/twin.md, "Dynamo's replay beside the twin").

`kvlab twin --policies round-robin,kv-aware,dynamo-round-robin,dynamo-kv-router` runs the
`dynamo-*` names through `dynamo._core.run_mocker_trace_replay` (PyPI `ai-dynamo-runtime`, the
`dynamo` extra): Dynamo's KV router (or its round-robin) in front of its mocker engines, in its own
virtual time, on the same Mooncake rows the twin sends. The engines get the twin plan's sizes
(block size, KV blocks per worker, max_num_seqs, max_num_batched_tokens, prefix caching and
chunked prefill on); the router gets the plan's KV-event delay as `kv_event_lag_ms` and the
trace's time scale as `arrival_speedup_ratio` (its inverse). Everything else is Dynamo's default:
the router's `KvRouterConfig()` and the mocker's own timing model (not kvlab's latency profile),
so hit rates compare directly and TTFTs differ by what the two timing models assume.

Each replayed request becomes a kvlab `Record` (the mocker's `reused_input_tokens` as the
delivered cached tokens), so the rows go through the same `summarize`, compare row and pages as
the twin's, marked as a peer and labelled as Dynamo's simulator.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

from kvlab.errors import ConfigError
from kvlab.kvcache.hashing import block_keys
from kvlab.load.measure import Record
from kvlab.load.oracle import Oracle, Prompt, ceiling
from kvlab.load.summary import Slo, Summary, open_loop, summarize
from kvlab.load.workloads.trace import Trace, TraceRow
from kvlab.twin.settings import Plan

PREFIX = "dynamo-"
MODES = {"dynamo-round-robin": "round_robin", "dynamo-kv-router": "kv_router"}
PACKAGE = "ai-dynamo-runtime"
INSTALL = "pip install 'kvlab[dynamo]'"


def source() -> str:
    """What made the figures, for every page and summary that carries them."""
    return f"Dynamo's mocker replay ({PACKAGE} {version()}): virtual time, Dynamo's simulator (not kvlab's twin)"


def version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "not installed"


def split(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """The given policy names as (kvlab presets, Dynamo replays); an unknown `dynamo-*` name is an error."""
    unknown = [n for n in names if n.startswith(PREFIX) and n not in MODES]
    if unknown:
        raise ConfigError(f"unknown Dynamo replay {', '.join(unknown)} (known: {', '.join(MODES)})")
    return [n for n in names if n not in MODES], [n for n in names if n in MODES]


def _core() -> Any:
    try:
        os.environ.setdefault("DYN_LOG", "warn")   # its router logs every decision at info
        from dynamo import _core  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise ConfigError(f"the dynamo-* policies run Dynamo's own replay, which needs the {PACKAGE} package: "
                          f"{INSTALL}") from None
    return _core


def check(plan: Plan) -> None:
    """Refuse a plan Dynamo's replay cannot run the same way (before anything runs)."""
    if not isinstance(plan.workload, Trace) or not plan.trace_timing:
        raise ConfigError("the dynamo-* policies replay a Mooncake trace at its own timing: give --trace "
                          "(without --users or --rate)")
    if any(m.role != "both" or m.dp_rank is not None for m in plan.members):
        raise ConfigError(f"the dynamo-* policies run aggregated workers only; topology {plan.topology.name} has "
                          "P/D pools or data-parallel ranks")
    rows = len(plan.workload.rows)
    if plan.settings.requests > rows:
        raise ConfigError(f"Dynamo's replay sends the trace once: --requests at most {rows} for this trace "
                          f"(got {plan.settings.requests})")
    _core()


def engine_args(plan: Plan, speedup_ratio: float = 1.0) -> dict[str, Any]:
    """The mocker engine's settings, matched to the twin's replicas (Dynamo's `engine` section);
    `speedup_ratio` scales the mocker's own timing model (below 1: slower)."""
    sim = plan.sim
    return {"engine": {"block_size": sim.block_size, "num_gpu_blocks": plan.num_blocks,
                       "max_num_seqs": sim.max_num_seqs, "max_num_batched_tokens": sim.max_num_batched_tokens,
                       "enable_prefix_caching": True, "enable_chunked_prefill": True,
                       "speedup_ratio": speedup_ratio}}


def prefill_matched_speedup(plan: Plan, tokens: int = 8192) -> float:
    """The mocker's `speedup_ratio` that makes its idle prefill of `tokens` take as long as the
    plan's profile takes (one request alone, chunked at the batch limit): the two timing models
    then agree on a cold prompt's compute, and what remains of a TTFT difference is their decode
    and batching assumptions (docs/twin.md)."""
    core = _core()
    alone = core.run_mocker_synthetic_trace_replay(tokens, 2, 1, replay_concurrency=1,
                                                   extra_engine_args=engine_args(plan))
    budget, done, kvlab_ms = plan.sim.max_num_batched_tokens, 0, 0.0
    while done < tokens:
        n = min(budget, tokens - done)
        kvlab_ms += plan.profile.step_ms(n, 0, (done + n / 2) * n / 1000, admitted=1 if done == 0 else 0)
        done += n
    return float(alone.summary["mean_ttft_ms"]) / (kvlab_ms * plan.sim.time_scale)


def rows_of(plan: Plan) -> list[TraceRow]:
    """The trace rows the twin sends: the first `requests`, cut at `duration_s` of (scaled) trace time."""
    assert isinstance(plan.workload, Trace)
    s = plan.settings
    rows = list(plan.workload.rows[:s.requests])
    if s.duration_s is not None:
        offsets = plan.workload.offsets(s.time_scale)
        rows = [r for r, at in zip(rows, offsets) if at < s.duration_s]
    return rows


def _trace_file(plan: Plan, rows: list[TraceRow], path: Path) -> None:
    """The rows as a Mooncake file with the workload's token scale applied (its block tokens follow it)."""
    assert isinstance(plan.workload, Trace)
    scale = plan.workload.params.token_scale
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"timestamp": r.timestamp, "input_length": max(1, round(r.input_length * scale)),
                                "output_length": max(1, round(r.output_length * scale)),
                                "hash_ids": list(r.hash_ids)}) + "\n")


def oracle(plan: Plan, rows: list[TraceRow]) -> Oracle:
    """The trace's ceiling on the plan's pooled KV, from its hash ids (each id: `block_tokens` tokens
    of its own; a sub-block's key is its id's prefix chain, as Dynamo's replay expands them)."""
    assert isinstance(plan.workload, Trace)
    size, per_id = plan.sim.block_size, plan.workload.block_tokens
    scale = plan.workload.params.token_scale
    prompts = []
    for r in rows:
        tokens = max(1, round(r.input_length * scale))
        ids = [h * per_id + j for h in r.hash_ids for j in range(per_id)][:tokens]
        prompts.append(Prompt(tokens, block_keys(ids, size)))
    return ceiling(prompts, size, plan.replicas * plan.num_blocks)


@dataclass(slots=True)
class DynamoResult:
    """One Dynamo replay: its summary, records and what the replay reported of itself."""

    name: str
    summary: Summary
    records: list[Record]
    report: dict[str, Any]      # Dynamo's own summary (its percentiles, prefix_cache_reused_ratio, ...)
    wall_s: float

    @property
    def virtual_s(self) -> float:
        return float(self.report.get("duration_ms", 0.0)) / 1000


def records_of(name: str, rows: list[TraceRow], per_request: list[dict[str, Any]]) -> list[Record]:
    """Dynamo's per-request report as kvlab records (times from the first arrival; worker N as `worker-N`)."""
    out = []
    for i, q in enumerate(sorted(per_request, key=lambda q: float(q["arrival_time_ms"]))):
        done = q.get("terminal_status") == "completed" and q.get("ttft_ms") is not None
        worker = q.get("decode_worker_idx")
        out.append(Record(ts=float(q["arrival_time_ms"]) / 1000, phase=name, policy=name, workload="trace",
                          group=f"h{rows[i].hash_ids[0]}" if i < len(rows) and rows[i].hash_ids else "",
                          session=i, status=200 if done else 0,
                          ttft_ms=q.get("ttft_ms"), itl_ms=q.get("itl_ms"), tpot_ms=q.get("itl_ms"),
                          e2e_ms=float(q.get("e2e_latency_ms") or 0.0), prompt_tokens=int(q["input_length"]),
                          output_tokens=int(q.get("output_length") or 0),
                          cached_tokens=int(q.get("reused_input_tokens") or 0),
                          replica=f"worker-{worker}" if worker is not None else None,
                          error=None if done else f"dynamo: {q.get('terminal_status')}"))
    return out


def run(plan: Plan, name: str, rows: list[TraceRow] | None = None, speedup_ratio: float = 1.0) -> DynamoResult:
    """Replay the plan's trace through Dynamo's router `name` (a key of MODES) and mocker engines
    (`speedup_ratio`: the mocker's timing scaled, e.g. by `prefill_matched_speedup`)."""
    assert isinstance(plan.workload, Trace)
    core = _core()
    rows = rows if rows is not None else rows_of(plan)
    lag = plan.information.kv_event_delay_ms
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvlab-dynamo-") as tmp:
        path = Path(tmp) / "trace.jsonl"
        _trace_file(plan, rows, path)
        result = core.run_mocker_trace_replay(
            [str(path)], extra_engine_args=engine_args(plan, speedup_ratio), num_workers=plan.replicas,
            router_mode=MODES[name],
            arrival_speedup_ratio=1 / plan.settings.time_scale, trace_block_size=plan.workload.block_tokens,
            capture_per_request=True, kv_event_lag_ms=lag if MODES[name] == "kv_router" and lag > 0 else None)
    wall = time.perf_counter() - start
    report = dict(result.summary)
    records = records_of(name, rows, list(result.per_request or []))
    summary = summarize(records, Slo())
    summary.open_loop = open_loop(records, len(records) / max(report.get("duration_ms", 0.0) / 1000, 1e-9),
                                  "trace", plan.settings.time_scale, summary.duration_s)
    summary.phase = summary.policy = name
    summary.target = "dynamo-replay"
    summary.seed = plan.settings.seed
    summary.workload = plan.workload.name
    summary.workload_params = msgspec.to_builtins(plan.workload.params)
    return DynamoResult(name, summary, records, report, wall)
