"""A stepped open-loop ramp and its per-stage results, as inference-perf runs and reports one.

inference-perf's load config is `stages: [{rate, duration}]` (requests/s for seconds), each stage
sent by the same arrival process (`load.type: poisson` or `constant`); its report has a table per
stage (`report.request_lifecycle.per_stage`). llm-d's capacity benchmarks put a warm-up stage
first (llm-d/llm-d-kv-cache-manager `benchmarking/73-capacity/README.md`: 50 s at 15 QPS, then
3 -> 60 QPS). A request belongs to the stage it was sent in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated

import msgspec
import numpy as np

from kvlab.config import Strict
from kvlab.errors import ConfigError
from kvlab.load.arrival import Arrival
from kvlab.load.measure import Record


class Stage(Strict, frozen=True):
    rate: Annotated[float, msgspec.Meta(gt=0)]        # requests/s
    duration: Annotated[float, msgspec.Meta(gt=0)]    # seconds
    warmup: bool = False                              # sent, but left out of the pooled results


def parse(text: str, warmup: bool = False) -> list[Stage]:
    """`RATE:SECONDS[,RATE:SECONDS...]` (the command line's `--stages` / `--warmup`)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        rate, _, dur = part.partition(":")
        try:
            out.append(Stage(rate=float(rate), duration=float(dur), warmup=warmup))
        except ValueError:
            raise ConfigError(f"a stage is RATE:SECONDS, e.g. 15:50 (got {part!r})") from None
        if out[-1].rate <= 0 or out[-1].duration <= 0:
            raise ConfigError(f"a stage's rate and duration must be > 0 (got {part!r})")
    return out


def send_times(stages: Sequence[Stage], process: str, seed: int) -> Iterator[float]:
    """Send times in seconds: each stage's arrivals at its rate, from its start to its end."""
    start = 0.0
    for i, st in enumerate(stages):
        t = start
        for gap in Arrival(rate=st.rate, process=process).gaps(seed * 1009 + i):   # type: ignore[arg-type]
            if t >= start + st.duration - 1e-9:   # a float sum of equal gaps lands just short
                break
            yield t
            t += gap
        start += st.duration


def bound(stages: Sequence[Stage]) -> int:
    """More requests than the stages will send (a Poisson count stays under mean + 6 sd + 10)."""
    return sum(int(s.rate * s.duration + 6 * (s.rate * s.duration) ** 0.5 + 10) for s in stages)


class StageResult(Strict, frozen=True):
    """One stage of a run, as inference-perf's per-stage table plus what the engines reported."""

    rate: float
    duration_s: float
    warmup: bool
    requests: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    output_tok_s: float            # output tokens delivered during the stage (any request's) / its duration
    hit_rate: float                # cached / prompt tokens, as the engines reported them
    false_hit_rate: float          # predicted but not delivered (the index's stale claims) / prompt tokens
    kv_usage_mean: float | None    # over replicas and scrapes in the stage
    kv_usage_p90: float | None
    waiting_mean: float | None     # per replica


def _delivered(records: Sequence[Record], start: float, end: float) -> float:
    """Output tokens delivered in [start, end): each request's tokens spread evenly from its first
    token to its last (a record keeps TTFT and end-to-end time, not every token's time)."""
    total = 0.0
    for r in records:
        if r.ttft_ms is None or r.e2e_ms is None or not r.output_tokens:
            continue
        first, last = r.ts + r.ttft_ms / 1000.0, r.ts + r.e2e_ms / 1000.0
        if last <= first:
            total += r.output_tokens if start <= first < end else 0
            continue
        overlap = min(last, end) - max(first, start)
        total += r.output_tokens * max(overlap, 0.0) / (last - first)
    return total


def _p(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def results(records: Sequence[Record], stages: Sequence[Stage],
            samples: Sequence[tuple[float, list[float], list[float]]] = ()) -> list[StageResult]:
    """Per-stage results; `samples` are (seconds, KV usage per replica, waiting per replica)."""
    out = []
    start = 0.0
    for st in stages:
        end = start + st.duration
        rs = [r for r in records if start <= r.ts < end]
        ttft = [r.ttft_ms / 1000.0 for r in rs if r.ttft_ms is not None]
        prompt = sum(r.prompt_tokens or 0 for r in rs) or 1
        false = sum(max((r.predicted_tokens or 0) - (r.cached_tokens or 0), 0) for r in rs)
        kv = [v for t, k, _ in samples if start <= t < end for v in k]
        wait = [v for t, _, w in samples if start <= t < end for v in w]
        out.append(StageResult(rate=st.rate, duration_s=st.duration, warmup=st.warmup, requests=len(rs),
                               ttft_p50_s=_p(ttft, 50), ttft_p90_s=_p(ttft, 90), ttft_p99_s=_p(ttft, 99),
                               output_tok_s=round(_delivered(records, start, end) / st.duration, 1),
                               hit_rate=round(sum(r.cached_tokens or 0 for r in rs) / prompt, 4),
                               false_hit_rate=round(false / prompt, 4),
                               kv_usage_mean=round(float(np.mean(kv)), 4) if kv else None,
                               kv_usage_p90=_p(kv, 90), waiting_mean=round(float(np.mean(wait)), 3) if wait else None))
        start = end
    return out
