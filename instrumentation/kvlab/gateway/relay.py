"""A replica's answer relayed to the client: a JSON body at once, or a stream event by event as it
arrives. Usage is read on the way (the delivered part of the decomposition) and the usage-only
chunk the client did not ask for is dropped. What the client received is kept in a `Progress`; a
replica that fails mid-way is returned as `Broken`, for the gateway to resume the generation on
another replica (resume.py) or to `end` the stream with an SSE error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
from aiohttp import web
from opentelemetry.trace import Status, StatusCode

from kvlab.contract import answer_decoder
from kvlab.errors import error_body
from kvlab.gateway.endpoints import Backend, Registry
from kvlab.gateway.exchange import Exchange
from kvlab.gateway.metrics import GatewayMetrics
from kvlab.gateway.resume import Broken, Progress, event_decoder
from kvlab.gateway.upstream import Attempt
from kvlab.telemetry import names

# the replica's own x-kvlab-* facts that reach the client
PASSED_THROUGH = (names.HEADER_REPLICA, names.HEADER_KV_TRANSFER_TOKENS, names.HEADER_KV_TRANSFER_MS)


def error_json(message: str, status: int = 502) -> bytes:
    """The OpenAI-shaped body of an upstream failure (a response body, or an SSE error event's data)."""
    return msgspec.json.encode(error_body(message, "UpstreamError", status))


def upstream_error(message: str, status: int = 502) -> web.Response:
    return web.Response(body=error_json(message, status), status=status, content_type="application/json")


class Relay:
    def __init__(self, metrics: GatewayMetrics, registry: Registry, policy: str) -> None:
        self.metrics, self.registry, self.policy = metrics, registry, policy

    async def answer(self, request: web.Request, ex: Exchange, at: Attempt,
                     prog: Progress) -> web.StreamResponse | Broken:
        for name in PASSED_THROUGH:
            if name in at.resp.headers:
                ex.facts[name] = at.resp.headers[name]
        if ex.stream and at.resp.status == 200:
            return await self.stream(request, ex, at, prog)
        return await self.unary(ex, at, prog)

    async def unary(self, ex: Exchange, at: Attempt, prog: Progress) -> web.Response | Broken:
        r, resp, span = at.cand.replica, at.resp, ex.span
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            msg = f"{r.name} failed while answering: {type(exc).__name__}: {exc}"
            self.metrics.upstream_errors.labels(r.name, "body").inc()
            self.registry.failure(r, msg)
            at.span.set_attribute(names.UPSTREAM_ERROR, "body")
            at.span.set_status(Status(StatusCode.ERROR, msg))
            return Broken("body", msg, r)
        if resp.status == 200:
            try:
                ex.record_usage(answer_decoder.decode(data).usage, self.metrics.prefix_tokens)
            except msgspec.DecodeError:
                pass
        else:
            self.metrics.upstream_errors.labels(r.name, f"status_{resp.status}").inc()
            at.span.set_attribute(names.UPSTREAM_ERROR, "status")
        span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, resp.status)
        self.metrics.requests.labels(r.name, self.policy, str(resp.status)).inc()
        return web.Response(body=data, status=resp.status, headers={
            **ex.headers(), "Content-Type": resp.headers.get("Content-Type", "application/json")})

    async def stream(self, request: web.Request, ex: Exchange, at: Attempt,
                     prog: Progress) -> web.StreamResponse | Broken:
        """Relay events as they arrive; a failure before the end is returned as `Broken` (the stream
        stays open for a resume or `end`)."""
        r, resp, span = at.cand.replica, at.resp, ex.span
        if prog.out is None:
            prog.out = web.StreamResponse(status=200, headers={
                **ex.headers(), "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache"})
            await prog.out.prepare(request)
            span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, 200)
        out = prog.out
        buf = b""
        first = True
        broken: Broken | None = None
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                if b"\n\n" not in buf:
                    continue
                *events, buf = buf.split(b"\n\n")
                send = []
                for ev in events:
                    kept = self._event(ex, prog, ev, r)
                    if kept is None:
                        continue
                    if isinstance(kept, Broken):
                        broken = Broken(kept.reason, f"{r.name} sent an error event: {kept.error}", r)
                        break
                    send.append(kept)
                    send.append(b"\n\n")
                if send:
                    if first:
                        first = False
                        at.lease.first_token()
                        if not prog.started:
                            prog.started = True
                            ex.first_token(self.metrics.ttft)
                    await out.write(b"".join(send))
                if broken is not None:
                    break
            if broken is None and not (prog.done or prog.finished):
                broken = Broken("ended", f"{r.name} ended the stream before a finish reason", r)
        except (ConnectionResetError, asyncio.CancelledError):
            resp.close()   # the client went away: closing the upstream response aborts the generation there
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "stream"
            broken = Broken(kind, f"upstream replica {r.name} broke the stream: {type(exc).__name__}"
                                  + (f": {exc}" if str(exc) else ""), r)
        if broken is not None:
            self.metrics.upstream_errors.labels(r.name, broken.reason).inc()
            if broken.reason != "timeout":
                self.registry.failure(r, broken.error)
            at.span.set_attribute(names.UPSTREAM_ERROR, broken.reason)
            at.span.set_status(Status(StatusCode.ERROR, broken.error))
            return broken
        self.metrics.requests.labels(r.name, self.policy, "200").inc()
        if not prog.done and prog.finished:
            try:
                await out.write(b"data: [DONE]\n\n")
            except ConnectionResetError:
                pass
        try:
            await out.write_eof()
        except ConnectionResetError:
            pass
        return out

    def _event(self, ex: Exchange, prog: Progress, ev: bytes, r: Backend) -> bytes | Broken | None:
        """One upstream event as the client gets it (None: dropped), read on the way: text, finish,
        usage, an error event (returned as Broken)."""
        if ev == b"data: [DONE]":
            prog.done = True
            return ev
        if not ev.startswith(b"data: {"):
            return ev
        try:
            e = event_decoder.decode(ev[6:])
        except msgspec.DecodeError:
            return ev
        if e.error is not None:
            return Broken("error_event", msgspec.json.encode(e.error).decode(), r)
        if e.usage is not None:
            ex.record_usage(prog.usage(e.usage), self.metrics.prefix_tokens)
            if not ex.client_usage and not e.choices:
                return None   # the usage-only chunk the client did not ask for
        for ch in e.choices[:1]:
            piece = (ch.delta.content if ch.delta is not None else ch.text) or ""
            if piece:
                prog.text += piece
                prog.tokens += 1
            if ch.finish_reason is not None:
                prog.finished = True
        if not prog.resumes:
            if not prog.ident and e.id is not None:
                prog.ident = {"id": e.id, "created": e.created}
            return ev
        return prog.rewrite(ev[6:], e.usage)

    async def end(self, ex: Exchange, prog: Progress, message: str, status: int = 502) -> web.StreamResponse:
        """End a started stream with an OpenAI-shaped error event and `[DONE]`."""
        assert prog.out is not None
        ex.span.set_status(Status(StatusCode.ERROR, message))
        replica = ex.served.name if ex.served is not None else ""
        self.metrics.requests.labels(replica, self.policy, str(status)).inc()
        try:
            await prog.out.write(b"data: " + error_json(message, status) + b"\n\ndata: [DONE]\n\n")
            await prog.out.write_eof()
        except ConnectionResetError:
            pass
        return prog.out

    def failed(self, ex: Exchange, message: str, status: int = 502) -> web.Response:
        """The error answer when no replica served the request (or one failed before its body)."""
        ex.span.set_status(Status(StatusCode.ERROR, message))
        ex.span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, status)
        replica = ex.served.name if ex.served is not None else ""
        self.metrics.requests.labels(replica, self.policy, str(status)).inc()
        out = upstream_error(message, status)
        out.headers.update(ex.headers())
        return out
