"""The routing decision for one request body, without forwarding it: the bridge from the EPP to the
gateway's own state (router, indexes, load view, KV-event feed, tokenizer, metrics and spans).

`kvlab epp` builds one `Gateway` and uses it here as its scheduler; nothing about routing is
re-implemented, so `kvlab gateway` and `kvlab epp` make the same choice for the same state.
The calls into the gateway's request stages are kept in this one module on purpose: when the
gateway exposes a public "decide without forwarding" stage they are swapped here only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace

from kvlab.errors import NoEndpointAvailable, RequestError
from kvlab.gateway.endpoints import Replica
from kvlab.gateway.prefill import Prefill
from kvlab.gateway.router import Routed
from kvlab.gateway.server import Gateway, _Usage
from kvlab.telemetry import names

# request path -> the gateway's operation (what it tokenizes: messages or prompt)
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


def address(r: Replica) -> str:
    """`ip:port` of a replica, the form the protocol's destination header carries."""
    u = urlsplit(r.url)
    return f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}"


@dataclass(slots=True)
class Pick:
    """One decision and the bookkeeping the gateway would do while it forwards."""

    routed: Routed
    prompt_tokens: int
    endpoints: list[str]                  # ranked, chosen first
    replica: Replica                      # the one accounted as serving it
    work: int = 0                         # its uncached prompt tokens
    prefill: Prefill | None = None
    active: bool = False                  # accounted as in flight on `replica`
    headers: dict[str, str] = field(default_factory=dict)   # the x-kvlab-* facts for the client


class Picker:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.policy = gw.policy

    async def tokens(self, payload: dict[str, Any], path: str) -> list[int]:
        """Prompt token ids as the engine computes them; a path the gateway does not route by
        prompt (e.g. /v1/models) is routed on load alone."""
        operation = OPERATIONS.get(path)
        if operation is None:
            return []
        gw = self.gw
        t0 = time.perf_counter()   # attributes of the request span, as in the gateway (no child span)
        tokens, cache_hit = await gw._tokenize(payload, operation)
        dt = time.perf_counter() - t0
        trace.get_current_span().set_attributes({
            names.TOKENIZE_SOURCE: gw.tokenizer.source, names.PROMPT_TOKENS: len(tokens),
            names.TOKENIZE_CACHED: cache_hit, names.TOKENIZE_MS: dt * 1000})
        gw.metrics.tokenize.observe(dt)
        limit = gw.cfg.limits.max_prompt_tokens
        if limit is not None and len(tokens) > limit:
            raise RequestError(f"prompt of {len(tokens)} tokens exceeds the gateway limit of {limit}", "prompt")
        return tokens

    def pick(self, tokens: list[int], allowed: set[str] | None = None) -> Pick:
        """Rank the replicas for these tokens; `allowed` is the proxy's subset hint (`ip:port`)."""
        gw = self.gw
        if allowed is not None:
            exclude = frozenset(r.name for r in gw.registry.replicas.values() if address(r) not in allowed)
            if not allowed or len(exclude) == len(gw.registry.replicas):
                raise NoEndpointAvailable("no replica of the proxy's endpoint subset is known to the picker")
        else:
            exclude = frozenset()
        routed = gw.router.route(tokens, exclude) if exclude else gw._schedule(tokens)
        d = routed.decision
        ranked = d.ranked[: 1 + gw.cfg.limits.max_retries]
        p = Pick(routed, len(tokens), [address(c.replica) for c in ranked], d.chosen.replica)
        p.headers = {names.HEADER_POLICY: self.policy,
                     names.HEADER_PROMPT_TOKENS: str(len(tokens)),
                     names.HEADER_PREFIX_AVAILABLE: str(d.available_tokens)}
        self.serve(p, d.chosen.replica)
        return p

    def by_address(self, addr: str) -> Replica | None:
        return next((r for r in self.gw.registry.replicas.values() if address(r) == addr), None)

    def serve(self, p: Pick, r: Replica) -> None:
        """Account `r` as serving the request (in flight, prefill work ahead); moves the accounting
        when the proxy reports it fell back to another ranked endpoint."""
        self.release(p)
        cand = next((c for c in p.routed.decision.ranked if c.replica is r), p.routed.decision.chosen)
        p.replica = r
        p.work = max(0, p.prompt_tokens - cand.prefix_tokens)
        p.headers[names.HEADER_ROUTED_TO] = r.name
        p.headers[names.HEADER_PREFIX_PREDICTED] = str(cand.prefix_tokens)
        p.headers[names.HEADER_PREFIX_SPECULATIVE] = str(cand.speculative_tokens)
        r.inflight += 1
        r.routed += 1
        r.inflight_tokens += p.work
        p.prefill = self.gw.prefill.start(r, p.work)
        p.active = True

    def first_token(self, p: Pick, since: float) -> None:
        if p.prefill is not None:
            self.gw.prefill.first_token(p.prefill)
        self.gw.metrics.ttft.labels(self.policy, p.replica.name).observe(time.perf_counter() - since)

    def release(self, p: Pick) -> None:
        """The response ended or the stream went away: the replica's work is no longer ahead."""
        if not p.active:
            return
        p.active = False
        r = p.replica
        r.inflight -= 1
        r.inflight_tokens -= p.work
        if p.prefill is not None:
            self.gw.prefill.finish(p.prefill)

    def delivered(self, p: Pick, span: Any, usage: _Usage) -> None:
        self.gw._delivered(span, usage, p.headers)

    def count(self, p: Pick, status: int) -> None:
        self.gw.metrics.requests.labels(p.replica.name, self.policy, str(status)).inc()
