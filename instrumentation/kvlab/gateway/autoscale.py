"""The desired-replica recommendation: how many replicas the load the gateway sees needs.

Rule (docs/autoscaling.md), evaluated after every scrape round over the healthy endpoints,
data-parallel ranks grouped into their replica (a replica's queue is the sum of its ranks'
`vllm:num_requests_waiting`, its KV usage the mean of its ranks' `vllm:kv_cache_usage_perc`):

    ratio   = max(mean waiting per replica / target_waiting, mean KV usage / target_kv_usage)
    raw     = current                       if |ratio - 1| <= tolerance
              ceil(current * ratio)         otherwise
    raw     = min(raw, 2 * current, current + max_scale_up_step)      (scale-up rate limit)
    desired = clamp(max(raw over the last scale_down_window_s), min_replicas, max_replicas)

It is the Kubernetes HPA's proportional rule (desired = ceil(current * metric / target), 10 %
tolerance, scale-down stabilisation window = the maximum recommendation over the window) applied
to the two saturation signals llm-d's workload variant autoscaler watches (queue length and KV
cache utilisation). Scale-up is immediate; scale-down waits until the whole window agreed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from kvlab.config import Strict
from kvlab.gateway.endpoints import Backend


class AutoscaleSettings(Strict, frozen=True):
    """The `autoscale:` section of a gateway policy (docs/autoscaling.md)."""

    target_waiting: float = 2.0          # waiting requests per replica the pool should run at
    target_kv_usage: float = 0.7         # KV-cache usage (0..1) the pool should run at
    tolerance: float = 0.1               # no change while the ratio is within 1 +- tolerance
    min_replicas: int = 1
    max_replicas: int = 8
    scale_down_window_s: float = 10.0    # HPA's default is 300 s; a lab wants to see it fall
    max_scale_up_step: int = 4           # at most +4 replicas (and at most x2) per evaluation


@dataclass(frozen=True, slots=True)
class Recommendation:
    desired: int
    current: int
    reason: str                # up:queue | up:kv | down:queue | down:kv | hold:tolerance | hold:window | idle
    waiting_per_replica: float
    kv_usage: float
    ratio: float
    raw: int                   # before the scale-down window


class Recommender:
    def __init__(self, settings: AutoscaleSettings | None = None) -> None:
        self.s = settings or AutoscaleSettings()
        self._history: deque[tuple[float, int]] = deque()
        self.last: Recommendation | None = None

    def observe(self, replicas: Iterable[Backend], now: float | None = None) -> Recommendation:
        """A recommendation from the current load of `replicas` (healthy endpoints)."""
        now = time.monotonic() if now is None else now
        s = self.s
        groups: dict[str, list[Backend]] = {}
        for r in replicas:
            groups.setdefault(r.endpoint.replica or r.name, []).append(r)
        current = len(groups)
        if current == 0:
            rec = Recommendation(s.min_replicas, 0, "idle", 0.0, 0.0, 0.0, s.min_replicas)
            self.last = rec
            return rec
        waiting = sum(r.waiting for ranks in groups.values() for r in ranks) / current
        kv = sum(sum(r.kv_usage for r in ranks) / len(ranks) for ranks in groups.values()) / current
        q_ratio = waiting / s.target_waiting if s.target_waiting > 0 else 0.0
        kv_ratio = kv / s.target_kv_usage if s.target_kv_usage > 0 else 0.0
        ratio = max(q_ratio, kv_ratio)
        signal = "queue" if q_ratio >= kv_ratio else "kv"
        if abs(ratio - 1.0) <= s.tolerance:
            raw, reason = current, "hold:tolerance"
        else:
            raw = max(1, math.ceil(current * ratio - 1e-9))
            raw = min(raw, 2 * current, current + s.max_scale_up_step)
            reason = f"up:{signal}" if raw > current else (f"down:{signal}" if raw < current else "hold:tolerance")
        raw = max(s.min_replicas, min(s.max_replicas, raw))
        self._history.append((now, raw))
        while self._history and self._history[0][0] < now - s.scale_down_window_s:
            self._history.popleft()
        desired = max(v for _, v in self._history)
        if desired > raw and desired <= current:
            reason = "hold:window"
        rec = Recommendation(desired, current, reason, round(waiting, 3), round(kv, 4), round(ratio, 3), raw)
        self.last = rec
        return rec


def record_change(tracer: trace.Tracer, previous: Recommendation | None, rec: Recommendation) -> None:
    """A `gateway.autoscale` span with a `kvlab.autoscale.recommendation` event: the trace shows
    when and why the recommendation moved, next to the requests that moved it."""
    from kvlab.telemetry import names

    attrs: dict[str, AttributeValue] = {names.AUTOSCALE_DESIRED: rec.desired, names.AUTOSCALE_CURRENT: rec.current,
             names.AUTOSCALE_REASON: rec.reason, names.AUTOSCALE_QUEUE: rec.waiting_per_replica,
             names.AUTOSCALE_KV: rec.kv_usage}
    with tracer.start_as_current_span(names.SPAN_AUTOSCALE, attributes=attrs) as span:
        span.add_event(names.EVENT_AUTOSCALE, {**attrs, "kvlab.autoscale.previous_desired":
                                               previous.desired if previous else 0})
