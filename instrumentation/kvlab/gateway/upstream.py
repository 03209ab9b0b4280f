"""Calls from the gateway to replicas, with one bookkeeping for every caller: the proxied request,
the P/D prefill call and chunked decoding.

A `Lease` is a request's claim on one replica while it is served: counted in flight and routed,
its uncached prompt tokens booked as in-flight tokens and as prefill work ahead until its first
token (prefill.py). `Upstream.call` tries ranked candidates in order (at most 1 + max_retries) and
moves on only when the replica never answered: refused or dropped connection, or no response
headers within `first_byte_s` (the closed connection aborts the request there, as vLLM does on a
disconnect). Anything after the headers belongs to the caller's handler, which sees the response once
(a replica lost after that is the gateway's to resume elsewhere: resume.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
from aiohttp.client import _RequestContextManager
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.endpoints import Backend, Registry
from kvlab.gateway.exchange import Exchange
from kvlab.gateway.metrics import GatewayMetrics
from kvlab.gateway.prefill import Prefill, PrefillBook
from kvlab.gateway.pull import hint as pull_hint
from kvlab.gateway.router import Router
from kvlab.gateway.scheduler.base import Candidate
from kvlab.telemetry import genai, names

# The replica never answered, so nothing reached the client: the next one may serve it.
RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)

T = TypeVar("T")


class Lease:
    """A request's claim on `replica` until `release()` (idempotent)."""

    __slots__ = ("active", "book", "prefill", "replica", "work")

    def __init__(self, book: PrefillBook, replica: Backend, work: int) -> None:
        self.book, self.replica, self.work = book, replica, work
        replica.inflight += 1
        replica.routed += 1
        replica.inflight_tokens += work
        self.prefill: Prefill = book.start(replica, work)
        self.active = True

    def first_token(self) -> None:
        self.book.first_token(self.prefill)

    def release(self) -> None:
        if not self.active:
            return
        self.active = False
        self.replica.inflight -= 1
        self.replica.inflight_tokens -= self.work
        self.book.finish(self.prefill)


@dataclass(frozen=True, slots=True)
class Call:
    """One kind of upstream call."""

    name: str                              # its client span (names.SPAN_UPSTREAM, SPAN_DECODE_CALL, SPAN_PREFILL_CALL)
    path: str
    body: bytes
    stream: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)   # extra request headers
    primary: bool = True                   # serves the client (retries counted, the exchange's replica)
    error_label: str = ""                  # prefix of the upstream-error metric's kind ("prefill_")
    retry_timeouts: bool = True            # a replica that sent no headers in time is passed over too


@dataclass(slots=True)
class Attempt:
    """What a handler gets: the response headers are in; the body is the handler's to read."""

    index: int
    cand: Candidate
    span: trace.Span                       # the call's client span
    lease: Lease
    resp: aiohttp.ClientResponse
    start_ns: int = 0                      # when the call was made (Unix ns)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why no replica served the call: `kind` (connect, timeout, or the handler's own) and the last tried."""

    kind: str
    error: str
    replica: Backend | None = None


class Upstream:
    def __init__(self, cfg: PolicyConfig, registry: Registry, router: Router, metrics: GatewayMetrics,
                 tracer: trace.Tracer) -> None:
        self.cfg, self.registry, self.router, self.metrics, self.tracer = cfg, registry, router, metrics, tracer
        self.book = PrefillBook()
        self.session: aiohttp.ClientSession | None = None   # set at startup
        t = cfg.timeouts
        self._stream = aiohttp.ClientTimeout(total=t.total_s, sock_connect=t.connect_s, sock_read=t.stream_idle_s)
        self._unary = aiohttp.ClientTimeout(total=t.total_s, sock_connect=t.connect_s, sock_read=t.first_byte_s)

    def timeout(self, stream: bool) -> aiohttp.ClientTimeout:
        return self._stream if stream else self._unary

    def lease(self, replica: Backend, work: int) -> Lease:
        return Lease(self.book, replica, work)

    def post(self, r: Backend, path: str, body: bytes, stream: bool,
             headers: Mapping[str, str] | None = None) -> _RequestContextManager:
        """The one HTTP call to a replica: a JSON body, the current trace context, the call's timeouts."""
        assert self.session is not None
        sent = {"Content-Type": "application/json", **(headers or {})}
        propagate.inject(sent)
        return self.session.post(r.url + path, data=body, headers=sent, timeout=self.timeout(stream))

    async def call(self, ex: Exchange, ranked: Sequence[Candidate], call: Call,
                   handle: Callable[[Attempt], Awaitable[T | Failure]]) -> T | Failure:
        """Try `ranked` in order; the handler's result for the first replica that answers."""
        assert self.session is not None
        failure = Failure("none", "no replica tried")
        for index, cand in enumerate(ranked[: 1 + self.cfg.limits.max_retries]):
            r = cand.replica
            if call.primary:
                if index:
                    self.metrics.retries.labels(r.name).inc()
                    assert ex.routed is not None
                    self.router.learn(r, ex.routed.keys_by_size)
                ex.serve(cand)
                ex.span.set_attribute(names.SCHEDULE_ATTEMPT, index)
            span_name, attrs = genai.call_of(ex.span, call.name, r.url)
            start_ns = time.time_ns()
            with self.tracer.start_as_current_span(span_name, kind=SpanKind.CLIENT, attributes=attrs) as up:
                up.set_attributes({names.REPLICA: r.name, names.ENDPOINT: r.url, names.SCHEDULE_ATTEMPT: index,
                                   names.PREFIX_PREDICTED_TOKENS: cand.prefix_tokens})
                headers = dict(call.headers)
                pull = ex.routed.pull if ex.routed is not None and call.primary else None
                if pull is not None and pull.choice == "pull" and pull.target == r.name:
                    headers[names.HEADER_KV_PULL] = pull_hint(pull)
                lease = self.lease(r, ex.work(cand))
                try:
                    try:
                        resp = await asyncio.wait_for(self.post(r, call.path, call.body, call.stream, headers),
                                                      self.cfg.timeouts.first_byte_s)
                    except RETRYABLE as exc:
                        failure = self._failed(up, r, call, "connect", f"{r.name}: {type(exc).__name__}: {exc}")
                        continue
                    except TimeoutError:
                        failure = self._failed(up, r, call, "timeout", f"{r.name}: no response headers within "
                                                                       f"{self.cfg.timeouts.first_byte_s:g} s")
                        if call.retry_timeouts:
                            continue
                        return failure
                    self.registry.success(r)
                    up.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, resp.status)
                    try:
                        return await handle(Attempt(index, cand, up, lease, resp, start_ns))
                    except asyncio.CancelledError:
                        resp.close()   # the client went away: dropping the connection aborts the engine's work
                        raise
                    finally:
                        resp.release()
                except (ConnectionResetError, asyncio.CancelledError):
                    genai.client_gone(up)   # waiting for headers, or relaying the answer
                    raise
                finally:
                    lease.release()
        return failure

    def _failed(self, up: trace.Span, r: Backend, call: Call, kind: str, error: str) -> Failure:
        self.metrics.upstream_errors.labels(r.name, call.error_label + kind).inc()
        self.registry.failure(r, error)
        up.set_attribute(names.UPSTREAM_ERROR, kind)
        up.set_status(Status(StatusCode.ERROR, error))
        return Failure(kind, error, r)
