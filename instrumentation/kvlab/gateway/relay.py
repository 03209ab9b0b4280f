"""A replica's answer relayed to the client: a JSON body at once, or a stream event by event as it
arrives. Usage is read on the way (the delivered part of the decomposition) and the usage-only
chunk the client did not ask for is dropped; a stream that breaks mid-way ends with an SSE error
event and `[DONE]`.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
from aiohttp import web
from opentelemetry.trace import Status, StatusCode

from kvlab.contract import answer_decoder
from kvlab.gateway.endpoints import Registry
from kvlab.gateway.exchange import Exchange
from kvlab.gateway.metrics import GatewayMetrics
from kvlab.gateway.upstream import Attempt
from kvlab.telemetry import names

# the replica's own x-kvlab-* facts that reach the client
PASSED_THROUGH = (names.HEADER_REPLICA, names.HEADER_KV_TRANSFER_TOKENS, names.HEADER_KV_TRANSFER_MS)


def upstream_error(message: str, status: int = 502) -> web.Response:
    body = {"error": {"message": message, "type": "UpstreamError", "param": None, "code": status}}
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


class Relay:
    def __init__(self, metrics: GatewayMetrics, registry: Registry, policy: str) -> None:
        self.metrics, self.registry, self.policy = metrics, registry, policy

    async def answer(self, request: web.Request, ex: Exchange, at: Attempt) -> web.StreamResponse:
        for name in PASSED_THROUGH:
            if name in at.resp.headers:
                ex.facts[name] = at.resp.headers[name]
        if ex.stream and at.resp.status == 200:
            return await self.stream(request, ex, at)
        return await self.unary(ex, at)

    async def unary(self, ex: Exchange, at: Attempt) -> web.Response:
        r, resp, span = at.cand.replica, at.resp, ex.span
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            msg = f"{r.name} failed while answering: {type(exc).__name__}: {exc}"
            self.metrics.upstream_errors.labels(r.name, "body").inc()
            at.span.set_attribute(names.UPSTREAM_ERROR, "body")
            at.span.set_status(Status(StatusCode.ERROR, msg))
            return self.failed(ex, msg)
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

    async def stream(self, request: web.Request, ex: Exchange, at: Attempt) -> web.StreamResponse:
        r, resp, span = at.cand.replica, at.resp, ex.span
        out = web.StreamResponse(status=200, headers={
            **ex.headers(), "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache"})
        await out.prepare(request)
        span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, 200)
        buf = b""
        first = True
        status = "200"
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                if b"\n\n" not in buf:
                    continue
                *events, buf = buf.split(b"\n\n")
                send = []
                for ev in events:
                    if b'"usage"' in ev and ev.startswith(b"data: {"):
                        try:
                            parsed = answer_decoder.decode(ev[6:])
                        except msgspec.DecodeError:
                            parsed = None
                        if parsed is not None and parsed.usage is not None:
                            ex.record_usage(parsed.usage, self.metrics.prefix_tokens)
                            if not ex.client_usage and not parsed.choices:
                                continue   # the usage-only chunk the client did not ask for
                    send.append(ev)
                    send.append(b"\n\n")
                if send:
                    if first:
                        first = False
                        at.lease.first_token()
                        ex.first_token(self.metrics.ttft)
                    await out.write(b"".join(send))
            if buf.strip():
                await out.write(buf)
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away: closing the upstream response aborts the generation there
            status = "499"
            resp.close()
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "stream"
            msg = (f"upstream replica {r.name} broke the stream: {type(exc).__name__}"
                   + (f": {exc}" if str(exc) else ""))
            self.metrics.upstream_errors.labels(r.name, kind).inc()
            if kind == "stream":
                self.registry.failure(r, msg)
            at.span.set_attribute(names.UPSTREAM_ERROR, kind)
            at.span.set_status(Status(StatusCode.ERROR, msg))
            span.set_status(Status(StatusCode.ERROR, msg))
            span.set_attribute(names.ERROR_TYPE, type(exc).__name__)
            status = "502"
            err = {"error": {"message": msg, "type": "UpstreamError", "param": None, "code": 502}}
            try:
                await out.write(b"data: " + msgspec.json.encode(err) + b"\n\ndata: [DONE]\n\n")
            except ConnectionResetError:
                pass
        finally:
            self.metrics.requests.labels(r.name, self.policy, status).inc()
        try:
            await out.write_eof()
        except ConnectionResetError:
            pass
        return out

    def failed(self, ex: Exchange, message: str, status: int = 502) -> web.Response:
        """The error answer when no replica served the request (or one failed before its body)."""
        ex.span.set_status(Status(StatusCode.ERROR, message))
        ex.span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, status)
        replica = ex.served.name if ex.served is not None else ""
        self.metrics.requests.labels(replica, self.policy, str(status)).inc()
        out = upstream_error(message, status)
        out.headers.update(ex.headers())
        return out
