"""From per-request records (requests.jsonl) to summary.json; the schema is documented in docs/lab.md.

`Summary` is what summary.json holds, typed; every field has a default so summaries written by
older versions (without `itl_max_ms`, `speculative`, ...) still read back.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from kvlab.engine.sim.length import TOO_LONG
from kvlab.load.measure import UNFINISHED, Record
from kvlab.load.stages import StageResult

SCHEMA_VERSION = 1


class Percentiles(msgspec.Struct, kw_only=True):
    """p50/p95/p99 and mean of one latency in ms (None: no request measured it)."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None


class ShortPercentiles(msgspec.Struct, kw_only=True):
    """p50/p95 and mean (TPOT: summary.json has never carried its p99)."""

    p50: float | None = None
    p95: float | None = None
    mean: float | None = None


class HitRate(msgspec.Struct, kw_only=True):
    """Fractions of prompt tokens: longest cached anywhere, on the chosen replica (of which
    speculative), and what the engine delivered (None: no request reported it)."""

    available: float | None = None
    predicted: float | None = None
    speculative: float | None = None
    delivered: float | None = None


class Slo(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A service-level objective on each request: time to first token and time per output token
    (ms), both measured from the request's scheduled send time in an open-loop run."""

    ttft_ms: Annotated[float, msgspec.Meta(gt=0)] = 2000.0
    tpot_ms: Annotated[float, msgspec.Meta(gt=0)] = 200.0


LATE_MS = 50.0   # a send later than this after its scheduled time counts as late


class OpenLoop(msgspec.Struct, kw_only=True):
    """How an open-loop phase was sent: the offered rate, the arrival process, and how far the
    dispatcher fell behind its schedule (`late`: sends more than LATE_MS after their time;
    `unfinished`: requests still running when the phase ended, counted as errors too)."""

    offered_rps: float
    arrival: str                  # poisson | constant | gamma:CV | trace
    time_scale: float | None = None   # a trace's timestamps times this
    sent: int = 0
    sent_rps: float | None = None     # sent / the phase's length: what was offered (a trace's start
                                      # can be slower or faster than its mean)
    lateness_ms: Percentiles = msgspec.field(default_factory=Percentiles)
    lateness_max_ms: float | None = None
    late: int = 0
    unfinished: int = 0

    @property
    def behind(self) -> bool:
        """Whether the dispatcher fell behind: over 1 % of its sends were late."""
        return self.late > 0.01 * max(self.sent, 1)


class Goodput(msgspec.Struct, kw_only=True):
    """Requests that met the SLO: how many, per second of the phase's window, and their share."""

    slo: Slo
    met: int = 0
    rps: float = 0.0
    share: float | None = None


class Summary(msgspec.Struct, kw_only=True):
    """One phase's summary.json (`summarize` fills the statistics, `run_bench` how it was run)."""

    schema: int = SCHEMA_VERSION
    requests: int = 0
    ok: int = 0
    errors: int = 0
    first_error: str | None = None
    too_long: int = 0                  # of the errors: vLLM's 400 for prompt + max_tokens over the max model length
    too_long_prompt_max: int | None = None   # the longest such prompt (tokens)
    partial: bool = False              # the run was stopped (Ctrl-C, SIGTERM, a watchdog): what had finished
    duration_s: float = 0.0
    rps: float = 0.0
    output_tok_s: float = 0.0
    ttft_ms: Percentiles = msgspec.field(default_factory=Percentiles)
    itl_ms: Percentiles = msgspec.field(default_factory=Percentiles)
    itl_max_ms: Percentiles = msgspec.field(default_factory=Percentiles)
    token_itl_ms: Percentiles = msgspec.field(default_factory=Percentiles)
    tpot_ms: ShortPercentiles = msgspec.field(default_factory=ShortPercentiles)
    e2e_ms: Percentiles = msgspec.field(default_factory=Percentiles)
    prompt_tokens: int = 0
    output_tokens: int = 0
    hit_rate: HitRate = msgspec.field(default_factory=HitRate)
    replicas: dict[str, int] = msgspec.field(default_factory=dict)
    goodput: Goodput | None = None     # with an SLO (run_bench always sets one)
    open_loop: OpenLoop | None = None  # None: closed-loop users
    # how it was run (run_bench; None in a summary that only summarize() made, or an older file)
    phase: str | None = None
    policy: str | None = None
    target: str | None = None
    users: int | None = None
    seed: int | None = None
    workload: str | None = None
    workload_params: dict[str, Any] | None = None
    configured_duration_s: float | None = None
    min_requests: int | None = None
    limit_s: float | None = None
    stages: list[StageResult] | None = None   # a stepped ramp's per-stage results (load/stages.py)

    def to_json(self) -> str:
        """summary.json's text (indented, like every JSON file of a run)."""
        return json.dumps(msgspec.to_builtins(self), indent=2) + "\n"


def read_summary(path: str | Path) -> Summary:
    """A phase's summary.json."""
    return msgspec.json.decode(Path(path).read_bytes(), type=Summary)


def _round(value: np.floating[Any]) -> float:
    return round(float(value), 3)


def _pcts(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles()
    arr = np.asarray(values, dtype=float)
    p50, p95, p99 = np.percentile(arr, (50, 95, 99))
    return Percentiles(p50=_round(p50), p95=_round(p95), p99=_round(p99), mean=_round(arr.mean()))


def _short_pcts(values: list[float]) -> ShortPercentiles:
    full = _pcts(values)
    return ShortPercentiles(p50=full.p50, p95=full.p95, mean=full.mean)


def _fraction(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def goodput(records: Sequence[Record], slo: Slo, window_s: float) -> Goodput:
    """Requests that succeeded with TTFT <= slo.ttft_ms and TPOT <= slo.tpot_ms (a one-token reply
    has no TPOT: TTFT alone decides), per second of `window_s`, and their share of all requests."""
    met = sum(1 for r in records if not r.error and r.ttft_ms is not None and r.ttft_ms <= slo.ttft_ms
              and (r.tpot_ms is None or r.tpot_ms <= slo.tpot_ms))
    return Goodput(slo=slo, met=met, rps=round(met / window_s, 3) if window_s > 0 else 0.0,
                   share=_fraction(met, len(records)))


def open_loop(records: Sequence[Record], offered_rps: float, arrival: str, time_scale: float | None = None,
              duration_s: float | None = None) -> OpenLoop:
    """The dispatcher's lateness over the requests it sent (unfinished ones included) in a phase
    of `duration_s`."""
    late = [r.lateness_ms for r in records if r.lateness_ms is not None]
    return OpenLoop(offered_rps=round(offered_rps, 4), arrival=arrival, time_scale=time_scale, sent=len(records),
                    sent_rps=round(len(records) / duration_s, 4) if duration_s else None,
                    lateness_ms=_pcts(late), lateness_max_ms=round(max(late), 3) if late else None,
                    late=sum(1 for x in late if x > LATE_MS),
                    unfinished=sum(1 for r in records if r.error == UNFINISHED))


def summarize(records: Sequence[Record], slo: Slo | None = None, min_window_s: float = 0.0) -> Summary:
    """Latency percentiles, throughput, hit-rate decomposition and routing spread of one run.

    Rates use the measured window (first request sent to last one finished; an open-loop phase's
    at least its length, `min_window_s`, however its sends bunched up); hit rates are token
    fractions over successful requests: sum(available|predicted|delivered) / sum(prompt tokens),
    computed over the requests that report that number (None when none do, e.g. no gateway);
    `speculative` is the part of `predicted` the gateway's index held only speculatively.
    Inter-token latency three ways: `itl_ms` over each request's mean gap, `itl_max_ms` over each
    request's worst gap (decode stalls), `token_itl_ms` over every gap of every request (vLLM's
    benchmark definition of ITL percentiles).
    """
    ok = [r for r in records if not r.error]
    errors = [r for r in records if r.error]
    too_long = [r.prompt_tokens or 0 for r in errors if r.status == 400 and TOO_LONG in (r.error or "")]
    window = 0.0
    if records:
        start = min(r.ts for r in records)
        end = max(r.ts + r.e2e_ms / 1000 for r in records)
        window = max(end - start, min_window_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)

    def hit(tokens: Callable[[Record], int | None]) -> float | None:
        rows = [(n, r.prompt_tokens) for r in ok if (n := tokens(r)) is not None and r.prompt_tokens]
        return _fraction(sum(n for n, _ in rows), sum(p or 0 for _, p in rows))

    return Summary(
        requests=len(records),
        ok=len(ok),
        errors=len(errors),
        first_error=errors[0].error if errors else None,
        too_long=len(too_long),
        too_long_prompt_max=max(too_long, default=None),
        duration_s=round(window, 3),
        rps=round(len(ok) / window, 3) if window else 0.0,
        output_tok_s=round(out_tokens / window, 3) if window else 0.0,
        ttft_ms=_pcts([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        itl_ms=_pcts([r.itl_ms for r in ok if r.itl_ms is not None]),
        itl_max_ms=_pcts([r.itl_max_ms for r in ok if r.itl_max_ms is not None]),
        token_itl_ms=_pcts([g for r in ok for g in r.itl_gaps_ms or ()]),
        tpot_ms=_short_pcts([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        e2e_ms=_pcts([r.e2e_ms for r in ok]),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        output_tokens=out_tokens,
        hit_rate=HitRate(available=hit(lambda r: r.available_tokens), predicted=hit(lambda r: r.predicted_tokens),
                         speculative=hit(lambda r: r.speculative_tokens), delivered=hit(lambda r: r.cached_tokens)),
        replicas=dict(sorted(Counter(r.replica or "?" for r in ok).items())),
        goodput=goodput(records, slo, window) if slo is not None else None,
    )
