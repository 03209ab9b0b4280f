"""How many replicas a routing policy needs to meet an SLO on a workload: the fewest replica count
whose run meets it, found by doubling until one does and bisecting below it (the SLO's figures are
assumed to improve with replicas).

`search` is that search over any `Runner` (n replicas -> the records of one probe), every probe
judged by the same `judge`. `replicas_needed(settings, slo, policy)` asks it of kvlab's twin;
`dynamo_replicas_needed(settings, slo, name)` asks it of Dynamo's own router and mocker replayed
offline (twin/dynamo.py) on the same trace rows: another simulator's answer beside kvlab's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import numpy as np

from kvlab.config import Strict
from kvlab.errors import ConfigError
from kvlab.load.measure import Record
from kvlab.load.summary import Slo, goodput
from kvlab.twin import dynamo
from kvlab.twin.runner import run
from kvlab.twin.settings import MAX_REPLICAS, TwinSettings, resolve

TWIN = "kvlab's twin (virtual time, kvlab's latency profile)"
Positive = Annotated[float, msgspec.Meta(gt=0)]


class Target(Strict, frozen=True):
    """The SLO a replica count must meet; errors (400s included) count as misses. A request's
    TTFT/TPOT against the p90 bounds also makes its goodput (requests meeting both)."""

    ttft_p90_ms: Positive = 2000.0
    ttft_p99_ms: Positive | None = None
    tpot_p90_ms: Positive = 100.0
    goodput_share: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None   # None: not part of the SLO

    def describe(self) -> str:
        parts = [f"TTFT p90 ≤ {self.ttft_p90_ms:,.0f} ms"]
        if self.ttft_p99_ms is not None:
            parts.append(f"TTFT p99 ≤ {self.ttft_p99_ms:,.0f} ms")
        parts.append(f"TPOT p90 ≤ {self.tpot_p90_ms:,.0f} ms")
        if self.goodput_share is not None:
            parts.append(f"goodput ≥ {self.goodput_share:.0%}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Probe:
    """One run at one replica count, judged against the SLO."""

    replicas: int
    met: bool
    ttft_p90_ms: float
    ttft_p99_ms: float
    tpot_p90_ms: float
    goodput: float          # share of requests meeting the per-request TTFT and TPOT bounds
    errors: int
    wall_s: float


@dataclass(slots=True)
class Answer:
    """A policy's fewest replicas (None: not met up to the search's limit), and every probe."""

    policy: str
    replicas: int | None
    gpus_per_replica: int
    limit: int
    source: str = TWIN          # the simulator whose runs the probes judged
    probes: dict[int, Probe] = field(default_factory=dict)

    @property
    def peer(self) -> bool:
        """Sized by another project's simulator, not kvlab's twin."""
        return self.source != TWIN

    @property
    def gpus(self) -> int | None:
        return None if self.replicas is None else self.replicas * self.gpus_per_replica


def _pct(values: list[float], q: float) -> float:
    """The q-th percentile; infinite where it falls among the errors' (infinite) values."""
    if not values:
        return 0.0
    with np.errstate(invalid="ignore"):   # inf - inf, between two errors: nan
        v = float(np.percentile(np.asarray(values), q))
    return math.inf if math.isnan(v) else v


def judge(records: list[Record], slo: Target, replicas: int, wall_s: float) -> Probe:
    """The SLO's figures over every request (an error's TTFT and TPOT are infinite)."""
    inf = float("inf")
    ttft = [r.ttft_ms if not r.error and r.ttft_ms is not None else inf for r in records]
    tpot = [inf if r.error or r.tpot_ms is None else r.tpot_ms for r in records if r.error or r.tpot_ms is not None]
    good = goodput(records, Slo(ttft_ms=slo.ttft_p90_ms, tpot_ms=slo.tpot_p90_ms), 1.0).share or 0.0
    p90, p99, t90 = _pct(ttft, 90), _pct(ttft, 99), _pct(tpot, 90)
    met = (bool(records) and p90 <= slo.ttft_p90_ms and t90 <= slo.tpot_p90_ms
           and (slo.ttft_p99_ms is None or p99 <= slo.ttft_p99_ms)
           and (slo.goodput_share is None or good >= slo.goodput_share))
    return Probe(replicas, met, p90, p99, t90, good, sum(1 for r in records if r.error), wall_s)


Runner = Callable[[int], tuple[list[Record], float]]   # n replicas -> a probe's records and wall seconds


def search(answer: Answer, runner: Runner, slo: Target, start: int = 1,
           report: Callable[[Probe], None] | None = None) -> Answer:
    """Fill `answer` (its probes, and its replicas if `slo` is met by `answer.limit`) from `runner`."""
    _check_range(start, answer.limit)

    def probe(n: int) -> bool:
        if n not in answer.probes:
            records, wall_s = runner(n)
            answer.probes[n] = p = judge(records, slo, n, wall_s)
            if report is not None:
                report(p)
        return answer.probes[n].met

    lo, hi = start - 1, start   # lo fails (or is below the range), hi is the next to try
    while not probe(hi):
        if hi == answer.limit:
            return answer
        lo, hi = hi, min(hi * 2, answer.limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            hi = mid
        else:
            lo = mid
    answer.replicas = hi
    return answer


def replicas_needed(settings: TwinSettings, slo: Target, policy: str, limit: int = 64, start: int = 1,
                    report: Callable[[Probe], None] | None = None) -> Answer:
    """The fewest replicas (1..limit) with which `policy` meets `slo` on `settings`' workload, in the twin."""
    _check_range(start, limit)
    first = resolve(msgspec.structs.replace(settings, policy=policy, replicas=start))

    def twin(n: int) -> tuple[list[Record], float]:
        r = run(first if n == start else resolve(msgspec.structs.replace(settings, policy=policy, replicas=n)),
                oracle=False)
        return r.records, r.wall_s

    return search(Answer(first.policy.name, None, first.profile.gpus_per_replica, limit), twin, slo, start, report)


def dynamo_replicas_needed(settings: TwinSettings, slo: Target, name: str, limit: int = 64, start: int = 1,
                           report: Callable[[Probe], None] | None = None) -> Answer:
    """The same question asked of Dynamo's replay: `name` (a `dynamo-*` router) in front of N of its
    mocker engines sized as the twin's replicas, on the rows a twin probe sends (ConfigError where
    the package is missing or the settings are not a trace at its own timing)."""
    _check_range(start, limit)
    if name not in dynamo.MODES:
        raise ConfigError(f"{name} is not a Dynamo replay (known: {', '.join(dynamo.MODES)})")
    first = resolve(msgspec.structs.replace(settings, replicas=start))
    dynamo.check(first)
    rows = dynamo.rows_of(first)

    def replay(n: int) -> tuple[list[Record], float]:
        r = dynamo.run(first if n == start else resolve(msgspec.structs.replace(settings, replicas=n)), name, rows)
        return r.records, r.wall_s

    answer = Answer(name, None, first.profile.gpus_per_replica, limit, dynamo.source())
    return search(answer, replay, slo, start, report)


def _check_range(start: int, limit: int) -> None:
    if not 1 <= start <= limit <= MAX_REPLICAS:
        raise ConfigError(f"the replica search needs 1 <= start <= limit <= {MAX_REPLICAS} (got {start}, {limit})")
