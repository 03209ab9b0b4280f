"""One request on its way through the gateway (or the EPP): what the client asked for, how it was
routed, which replica serves it and what that replica delivered.

Counts stay ints here; the client's `x-kvlab-*` headers are rendered from them when a response
starts (`headers()`), so nothing round-trips through strings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from kvlab.contract import Usage
from kvlab.gateway.router import Routed
from kvlab.gateway.scheduler.base import Candidate, Decision
from kvlab.telemetry import names

OPERATIONS = {"chat": "/v1/chat/completions", "text_completion": "/v1/completions"}


def exemplar(span: trace.Span) -> dict[str, str] | None:
    """The trace-id exemplar for a latency observation (None when the span is not recorded)."""
    ctx = span.get_span_context()
    return {"trace_id": format(ctx.trace_id, "032x")} if ctx.is_valid and ctx.trace_flags.sampled else None


@dataclass(slots=True)
class Exchange:
    operation: str                       # "chat" | "text_completion" | "" (routed on load alone)
    payload: dict[str, Any]
    span: trace.Span                     # the request's server span
    policy: str
    t_start: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    routed: Routed | None = None
    retention: dict[str, str] = field(default_factory=dict)   # directives for the replica (docs/semantic-kv.md)
    client_usage: bool = True            # False: the client did not ask for the streamed usage chunk
    chunk_tokens: int = 0                # > 0: served in chunks (docs/chunked-decoding.md)
    served: Candidate | None = None      # the candidate serving it (or tried last)
    facts: dict[str, str] = field(default_factory=dict)   # P/D and the replica's own x-kvlab-* facts
    delivered: int | None = None         # cached tokens the replica reported
    prefill_ns: tuple[int, int] | None = None   # a P/D split's prefill call: start, end (Unix ns)

    @property
    def stream(self) -> bool:
        return bool(self.payload.get("stream"))

    @property
    def path(self) -> str:
        return OPERATIONS.get(self.operation, "/v1/completions")

    @property
    def decision(self) -> Decision:
        assert self.routed is not None, "not routed yet"
        return self.routed.decision

    def work(self, cand: Candidate) -> int:
        """Prompt tokens `cand`'s replica still has to compute: the part its cache will not serve."""
        return max(0, len(self.tokens) - cand.prefix_tokens)

    def serve(self, cand: Candidate) -> None:
        """`cand` serves the request from now on (the first choice, a retry or the proxy's fallback)."""
        self.served = cand
        self.span.set_attribute(names.REPLICA, cand.name)
        self.span.set_attribute(names.PREFIX_PREDICTED_TOKENS, cand.prefix_tokens)
        self.span.set_attribute(names.PREFIX_SPECULATIVE_TOKENS, cand.speculative_tokens)

    def ask_usage(self) -> bool:
        """Ask the replica for the streamed usage chunk even when the client did not (the delivered part
        of the decomposition is `cached_tokens`); the relay drops that chunk again. True if the body changed."""
        if not self.stream:
            return False
        opts = self.payload.get("stream_options")
        self.client_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        if not self.client_usage:
            self.payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        return not self.client_usage

    def headers(self) -> dict[str, str]:
        """The client's x-kvlab-* headers: what was routed where, predicted and (once known) delivered."""
        h = {names.HEADER_POLICY: self.policy}
        if self.routed is not None:
            h[names.HEADER_PROMPT_TOKENS] = str(len(self.tokens))
            h[names.HEADER_PREFIX_AVAILABLE] = str(self.routed.decision.available_tokens)
        if self.served is not None:
            h[names.HEADER_ROUTED_TO] = self.served.name
            h[names.HEADER_PREFIX_PREDICTED] = str(self.served.prefix_tokens)
            h[names.HEADER_PREFIX_SPECULATIVE] = str(self.served.speculative_tokens)
        h.update(self.facts)
        if self.delivered is not None:
            h[names.HEADER_PREFIX_DELIVERED] = str(self.delivered)
        return h

    def record_usage(self, usage: Usage | None, prefix_tokens: Counter) -> None:
        """Record the decomposition once the replica reports what it reused. All five counters move
        together, per served request, so ratios of their rates never divide by a window in which only
        one side moved (which made the dashboards' hit rates spike to infinity)."""
        if usage is None:
            return
        cached = usage.cached_tokens
        self.delivered = cached
        self.span.set_attribute(names.PREFIX_DELIVERED_TOKENS, cached)
        if self.routed is not None and self.served is not None:
            for kind, value in (("prompt", len(self.tokens)), ("available", self.routed.decision.available_tokens),
                                ("predicted", self.served.prefix_tokens),
                                ("speculative", self.served.speculative_tokens), ("delivered", cached)):
                prefix_tokens.labels(self.policy, kind).inc(value)
        if usage.prompt_tokens is not None:
            self.span.set_attribute(names.GEN_AI_USAGE_INPUT_TOKENS, usage.prompt_tokens)
        if usage.completion_tokens is not None:
            self.span.set_attribute(names.GEN_AI_USAGE_OUTPUT_TOKENS, usage.completion_tokens)

    def first_token(self, ttft: Histogram) -> None:
        """The first streamed token reached the client: TTFT on the span and in the histogram."""
        seconds = time.perf_counter() - self.t_start
        self.span.set_attribute(names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, seconds)
        replica = self.served.name if self.served is not None else ""
        ttft.labels(self.policy, replica).observe(seconds, exemplar=exemplar(self.span))
