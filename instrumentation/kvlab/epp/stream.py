"""One ext_proc stream = one HTTP request through the proxy, as a small state machine.

Envoy sends, in order: request headers, request body (one or more chunks), [trailers], response
headers, response body chunks. In full-duplex streaming (what the Inference Extension requires and
the standalone Envoy config sets) the EPP answers the request headers only once the whole body has
arrived, because the pick needs the prompt; it hands the body back as one streamed chunk and the
response body chunk by chunk. In buffered mode the body arrives in one message and the headers are
answered at once. The hit-rate decomposition's delivered part (`usage.prompt_tokens_details.
cached_tokens`) is read from the response body when the proxy sends it here.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvlab import httpedge
from kvlab.contract import answer_decoder
from kvlab.epp import DESTINATION_HEADER
from kvlab.epp import protocol as proto
from kvlab.epp.bridge import OPERATIONS, Bridge, Pick
from kvlab.errors import NoEndpointAvailable, RequestError, error_body
from kvlab.telemetry import names

_BUFFERED = "BUFFERED"
_SUPPORTED = (proto.FULL_DUPLEX, _BUFFERED)


def _unavailable(message: str) -> ext_proc.ProcessingResponse:
    return proto.immediate(503, msgspec.json.encode(error_body(message, "ServiceUnavailableError", 503)))


class Stream:
    """The state of one request; `on(message)` returns the messages to send back."""

    def __init__(self, bridge: Bridge, max_body_bytes: int) -> None:
        self.bridge = bridge
        self.tracer = bridge.gw.tracer
        self.max_body = max_body_bytes
        self.req_mode = self.resp_mode = proto.FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.allowed: set[str] | None = None
        self.body = bytearray()
        self.span: trace.Span | None = None
        self.pick: Pick | None = None
        self.client_usage = True
        self.sse = False
        self.pending = b""           # an SSE event not complete yet
        self.resp_body = bytearray()  # a JSON response, kept to read its usage at the end
        self.t_start = time.perf_counter()
        self.first = True
        self.done = False

    # ---- dispatch ----------------------------------------------------------------------------
    async def on(self, req: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(req)
        if kind == "request_body":
            return await self._request_body(req.request_body)
        if kind == "request_trailers":
            return [proto.trailers(request=True)]
        if kind == "response_headers":
            return self._response_headers(req)
        if kind == "response_body":
            return self._response_body(req.response_body)
        if kind == "response_trailers":
            self.finish()
            return [proto.trailers(request=False)]
        return []

    # ---- request side ------------------------------------------------------------------------
    async def _request_headers(self, req: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        self.req_mode, self.resp_mode = proto.body_modes(req)
        self.headers = proto.headers_of(req.request_headers)
        self.allowed = proto.subset_hint(req)
        self.span = self.tracer.start_span(names.SPAN_EPP_REQUEST, context=propagate.extract(self.headers),
                                           kind=SpanKind.SERVER)
        self.span.set_attribute(names.POLICY, self.bridge.policy)
        path = self.headers.get(":path", "").split("?", 1)[0]
        if req.request_headers.end_of_stream:
            if path in OPERATIONS:
                return self._fail(RequestError("request has no body: expected a JSON object"))
            return await self._route({})
        if self.req_mode not in _SUPPORTED:
            return self._fail_unavailable(f"ext_proc request_body_mode {self.req_mode} cannot be routed on "
                                          "the prompt: configure FULL_DUPLEX_STREAMED or BUFFERED")
        if self.req_mode == _BUFFERED:
            return [proto.request_headers(proto.common())]
        return []     # full duplex: the headers are answered with the pick, once the body is in

    async def _request_body(self, body: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        self.body += body.body
        if len(self.body) > self.max_body:
            return self._fail(httpedge.HTTPError(413, f"request body exceeds {self.max_body} bytes"))
        if not body.end_of_stream:
            return []
        try:
            payload: dict[str, Any] = httpedge.decode(bytes(self.body))
            if "stream" in payload and not isinstance(payload["stream"], bool | None):
                raise RequestError("`stream` must be a boolean", "stream")
        except RequestError as err:
            return self._fail(err)
        return await self._route(payload)

    async def _route(self, body: dict[str, Any]) -> list[ext_proc.ProcessingResponse]:
        assert self.span is not None
        span = self.span
        stream = bool(body.get("stream"))
        span.set_attribute(names.GEN_AI_REQUEST_STREAM, stream)
        if isinstance(body.get("model"), str):
            span.set_attribute(names.GEN_AI_REQUEST_MODEL, body["model"])
        path = self.headers.get(":path", "").split("?", 1)[0]
        try:
            with trace.use_span(span, end_on_exit=False):
                self.pick = await self.bridge.pick(span, body, path if self.body else "", self.t_start, self.allowed)
        except RequestError as err:
            return self._fail(err)
        except NoEndpointAvailable as err:
            return self._fail_unavailable(str(err))
        p = self.pick
        upstream = {DESTINATION_HEADER: ",".join(p.endpoints)}
        with trace.use_span(span, end_on_exit=False):
            propagate.inject(upstream)      # the replica's engine.request continues this trace
        duplex = self.req_mode == proto.FULL_DUPLEX and self.resp_mode == proto.FULL_DUPLEX
        out_body = bytes(self.body)
        if stream and duplex:
            # ask the replica for usage (the delivered tokens) and drop that chunk again on the way
            # back if the client did not ask for it, as `kvlab gateway` does
            opts = body.get("stream_options")
            self.client_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            if not self.client_usage:
                body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                out_body = msgspec.json.encode(body)
        if out_body != bytes(self.body):
            upstream["content-length"] = str(len(out_body))
        headers = proto.common(upstream, clear_route_cache=True)
        if not self.body:           # a request without a body (e.g. GET /v1/models): routed on load
            return [proto.request_headers(headers, p.endpoints)]
        if self.req_mode == proto.FULL_DUPLEX:
            return [proto.request_headers(headers, p.endpoints),
                    proto.request_body(proto.common(body=out_body, end_of_stream=True))]
        return [proto.request_body(headers, p.endpoints)]     # buffered: the headers were answered already

    # ---- response side -----------------------------------------------------------------------
    def _response_headers(self, req: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        h = proto.headers_of(req.response_headers)
        extra: dict[str, str] = {}
        if self.pick is not None and self.span is not None:
            served = proto.served_endpoint(req)
            if served and served != self.pick.endpoints[0]:
                r = self.bridge.by_address(served)
                if r is not None:
                    self.bridge.serve(self.pick, r)
            status = int(h.get(":status", "0") or 0)
            self.span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, status)
            self.bridge.count(self.pick, status)
            self.sse = h.get("content-type", "").startswith("text/event-stream")
            extra = self.pick.ex.headers()
        out = [proto.response_headers(proto.common(extra))]
        if req.response_headers.end_of_stream:
            self.finish()
        return out

    def _response_body(self, body: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        chunk = bytes(body.body)
        if self.pick is not None and chunk and self.first:
            self.first = False
            self.bridge.first_token(self.pick)
        if self.sse:
            chunk = self._events(chunk, body.end_of_stream)
        elif len(self.resp_body) + len(chunk) <= self.max_body:
            self.resp_body += chunk
        if body.end_of_stream:
            if not self.sse and self.resp_body:
                self._usage(bytes(self.resp_body))
            self.finish()
        if self.resp_mode == proto.FULL_DUPLEX:
            return [proto.response_body(proto.common(body=chunk, end_of_stream=body.end_of_stream))]
        return [proto.response_body(proto.common())] if body.end_of_stream or self.resp_mode != _BUFFERED else []

    def _events(self, chunk: bytes, end: bool) -> bytes:
        """Complete SSE events of the stream so far, usage read and the usage-only chunk the client
        did not ask for dropped; an incomplete event waits for the next chunk."""
        buf = self.pending + chunk
        *events, self.pending = buf.split(b"\n\n")
        if end:
            events, self.pending = [*events, self.pending] if self.pending else events, b""
        out = []
        for ev in events:
            if ev.startswith(b"data: {") and b'"usage"' in ev:
                parsed = self._usage(ev[6:])
                if parsed is not None and not self.client_usage and not parsed.choices:
                    continue
            out.append(ev + b"\n\n")
        return b"".join(out)

    def _usage(self, data: bytes) -> Any:
        try:
            parsed = answer_decoder.decode(data)
        except msgspec.DecodeError:
            return None
        if parsed.usage is not None and self.pick is not None:
            self.bridge.delivered(self.pick, parsed.usage)
        return parsed

    # ---- endings -----------------------------------------------------------------------------
    def _fail(self, err: RequestError) -> list[ext_proc.ProcessingResponse]:
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, err.message))
            self.span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, err.status)
        self.finish()
        return [proto.error(err, {names.HEADER_POLICY: self.bridge.policy})]

    def _fail_unavailable(self, message: str) -> list[ext_proc.ProcessingResponse]:
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, message))
            self.span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, 503)
        self.finish()
        return [_unavailable(message)]

    def finish(self) -> None:
        """The request is over (or its stream went away): release the replica's accounting, end the span."""
        if self.done:
            return
        self.done = True
        if self.pick is not None:
            self.bridge.release(self.pick)
        if self.span is not None:
            self.span.end()
