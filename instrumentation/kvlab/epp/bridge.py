"""The routing decision for one request body, without forwarding it: the EPP's bridge to the
gateway's own state (router, indexes, load view, KV-event feed, tokenizer, metrics and spans).

`kvlab epp` builds one `Gateway` and asks it to `decide` — the stage `kvlab gateway` runs before
it forwards — so both make the same choice for the same state. The replica the proxy ends up
using is leased exactly as the gateway's own upstream calls lease theirs (gateway/upstream.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace

from kvlab.contract import Usage
from kvlab.errors import NoEndpointAvailable
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.exchange import Exchange
from kvlab.gateway.server import Gateway
from kvlab.gateway.upstream import Lease

# request path -> the gateway's operation (what it tokenizes: messages or prompt)
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


def address(r: Backend) -> str:
    """`ip:port` of a replica, the form the protocol's destination header carries."""
    u = urlsplit(r.url)
    return f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}"


@dataclass(slots=True)
class Pick:
    """One decision and the lease of the replica serving it."""

    ex: Exchange
    endpoints: list[str]                  # ranked, chosen first
    lease: Lease | None = None


class Bridge:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.policy = gw.policy

    async def pick(self, span: trace.Span, payload: dict[str, Any], path: str, t_start: float,
                   allowed: set[str] | None = None) -> Pick:
        """Rank the replicas for this body (routed on load alone when `path` is not one routed by
        prompt, e.g. GET /v1/models, or "" for a request without a body); `allowed` is the proxy's
        subset hint (`ip:port`)."""
        gw = self.gw
        if allowed is not None:
            exclude = frozenset(r.name for r in gw.registry.replicas.values() if address(r) not in allowed)
            if not allowed or len(exclude) == len(gw.registry.replicas):
                raise NoEndpointAvailable("no replica of the proxy's endpoint subset is known to the picker")
        else:
            exclude = frozenset()
        ex = Exchange(OPERATIONS.get(path, ""), payload, span, self.policy, t_start)
        await gw.decide(ex, exclude=exclude)
        ranked = ex.decision.ranked[: 1 + gw.cfg.limits.max_retries]
        p = Pick(ex, [address(c.replica) for c in ranked])
        self.serve(p, ex.decision.chosen.replica)
        return p

    def by_address(self, addr: str) -> Backend | None:
        return next((r for r in self.gw.registry.replicas.values() if address(r) == addr), None)

    def serve(self, p: Pick, r: Backend) -> None:
        """Lease `r` for the request; moves the lease when the proxy reports it fell back to another
        ranked endpoint."""
        self.release(p)
        d = p.ex.decision
        cand = next((c for c in d.ranked if c.replica is r), d.chosen)
        p.ex.serve(cand)
        p.lease = self.gw.upstream.lease(r, p.ex.work(cand))

    def first_token(self, p: Pick) -> None:
        if p.lease is not None:
            p.lease.first_token()
        p.ex.first_token(self.gw.metrics.ttft)

    def release(self, p: Pick) -> None:
        """The response ended or the stream went away: the replica's work is no longer ahead."""
        if p.lease is not None:
            p.lease.release()

    def delivered(self, p: Pick, usage: Usage) -> None:
        p.ex.record_usage(usage, self.gw.metrics.prefix_tokens)

    def count(self, p: Pick, status: int) -> None:
        served = p.ex.served.name if p.ex.served is not None else ""
        self.gw.metrics.requests.labels(served, self.policy, str(status)).inc()
