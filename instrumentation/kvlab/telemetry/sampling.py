"""kvlab's default sampler: every trace at lab rates, a bounded number of traces at saturation.

A lab wants every request's trace (its trace views count requests, a learner opens any one of
them), and it runs at 1-100 requests a second. A saturation load test of the same gateway would
spend a third of the gateway's throughput on spans at 100 % sampling (docs/benchmarks.md, "Tracing
cost"). A cap on new traces per second serves both: below the cap every trace is kept, above it the
cost stops growing with the load. Jaeger's `ratelimiting` sampler is the same idea (a token bucket
of traces per second); the OpenTelemetry SDK has none.

`RateLimited` decides only roots; `ParentBased` around it makes every other span follow its
parent, so a trace is kept or dropped whole and the gateway and the replicas follow the client.
The pair is registered as `parentbased_kvlab_ratelimited` in the SDK's `opentelemetry_traces_sampler`
entry points, `OTEL_TRACES_SAMPLER_ARG` being the traces a second, and is what kvlab's processes
use when `OTEL_TRACES_SAMPLER` is unset (`sampler_from_env`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from importlib.metadata import entry_points
from time import monotonic

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, TraceState, get_current_span
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

DEFAULT = "parentbased_kvlab_ratelimited"
DEFAULT_TRACES_PER_S = 200.0
ENTRY_POINTS = "opentelemetry_traces_sampler"
SDK_NAMES = ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off",
             "traceidratio", "parentbased_traceidratio")   # the SDK's TracerProvider reads these itself


class RateLimited(Sampler):
    """Samples at most `per_s` new traces a second (a token bucket holding one second's worth)."""

    def __init__(self, per_s: float) -> None:
        if not per_s > 0:
            raise ValueError(f"traces per second must be > 0, not {per_s!r}")
        self.per_s = per_s
        self._capacity = max(per_s, 1.0)
        self._tokens = self._capacity
        self._last = monotonic()
        self._lock = threading.Lock()   # Locust users are greenlets, but a sampler may serve threads

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str,
                      kind: SpanKind | None = None, attributes: Attributes = None,
                      links: Sequence[Link] | None = None, trace_state: TraceState | None = None) -> SamplingResult:
        with self._lock:
            now = monotonic()
            self._tokens = min(self._capacity, self._tokens + (now - self._last) * self.per_s)
            self._last = now
            sampled = self._tokens >= 1.0
            if sampled:
                self._tokens -= 1.0
        parent = get_current_span(parent_context).get_span_context()
        # the SDK's span starts with the attributes a sampler returns: the caller's, as its samplers do
        return SamplingResult(Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP,
                              attributes if sampled else None, parent.trace_state if parent.is_valid else None)

    def get_description(self) -> str:
        return f"RateLimited{{{self.per_s:g}/s}}"


def parentbased_ratelimited(arg: str | None) -> Sampler:
    """The entry point's factory: `arg` is OTEL_TRACES_SAMPLER_ARG (empty: the default rate)."""
    return ParentBased(RateLimited(float(arg) if arg and arg.strip() else DEFAULT_TRACES_PER_S))


def ratio_env(ratio: float) -> dict[str, str]:
    """The variables that sample `ratio` of the traces instead (parent-based); none for 1 or more,
    which leaves kvlab's default."""
    if ratio >= 1.0:
        return {}
    return {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(ratio)}


def sampler_from_env() -> Sampler | None:
    """The sampler `OTEL_TRACES_SAMPLER` names: unset, kvlab's default; a name of the SDK's own, None
    (its TracerProvider reads the variables itself); any other, the entry point of that name, as the
    SDK's configurator resolves it. A name or argument that fails is a warning and kvlab's default."""
    name = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "")
    if name in SDK_NAMES:
        return None
    if name and name != DEFAULT:
        try:
            found = entry_points(group=ENTRY_POINTS, name=name)
            if not found:
                raise LookupError("no such sampler")
            sampler = next(iter(found)).load()(arg)
            if not isinstance(sampler, Sampler):
                raise TypeError(f"its factory returned {type(sampler).__name__}")
            return sampler
        except Exception as exc:   # telemetry never breaks the caller
            log.warning("OTEL_TRACES_SAMPLER=%s: %s; using %s", name, exc, DEFAULT)
            arg = ""
    try:
        return parentbased_ratelimited(arg)
    except ValueError as exc:
        log.warning("OTEL_TRACES_SAMPLER_ARG=%r: %s; using %g traces/s", arg, exc, DEFAULT_TRACES_PER_S)
        return parentbased_ratelimited("")
