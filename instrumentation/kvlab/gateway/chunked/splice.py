"""One chunked request: its chunks on one replica, spliced into one response or one SSE stream.

Each chunk is an ordinary generation call with `max_tokens` = the chunk size. A resumed chunk
sends the text generated so far back: chat as the final assistant message with vLLM's
`continue_final_message: true, add_generation_prompt: false` (the template leaves the turn
open), completions as the prompt with the text appended. It goes to the same replica, whose
prefix cache then holds prompt + generated-so-far (or recomputes it if it was evicted: the
chunk span's `kvlab.chunk.cached_tokens` and the resume counter show which). llm-d's routing
sidecar has the same per-chunk request shape (experimental chunked decode) without a scheduler
between chunks. The client sees one stream: one id, no finish_reason until the last chunk, one
usage with the original prompt_tokens and the chunks' completion_tokens summed.

A replica that dies during a chunk is replaced like any other stream's (gateway/resume.py): what
the client received of that chunk stays, and the next chunk continues it on the replica `reroute`
picks, at most `limits.max_resumes` times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvlab.errors import RequestError
from kvlab.gateway.chunked.settings import ChunkedSettings
from kvlab.gateway.chunked.slots import CLASSES, SlotQueue, class_rank
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.exchange import Exchange
from kvlab.gateway.relay import error_json
from kvlab.gateway.resume import resume_body
from kvlab.gateway.upstream import Upstream
from kvlab.telemetry import names

_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ChunkMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.chunks = Counter(names.KVLAB_CHUNKS, "chunked-decode upstream calls", ["priority"], registry=r)
        self.holds = Counter(names.KVLAB_CHUNK_HOLDS, "chunks that waited for a slot", ["priority", "reason"],
                             registry=r)
        self.resumes = Counter(names.KVLAB_CHUNK_RESUMES, "resumed chunks by prefix reuse on their replica",
                               ["outcome"], registry=r)
        self.queue = Histogram(names.KVLAB_CHUNK_QUEUE_SECONDS, "wait for a chunk slot", ["priority"],
                               buckets=_QUEUE_BUCKETS, registry=r)


class _Chunk(msgspec.Struct):
    """What one chunk produced."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first: dict[str, Any] | None = None   # the first JSON object seen (the template of the answer)
    error: bytes | None = None            # an upstream error body or event, relayed as is
    status: int = 200
    streamed: int = 0                     # content events relayed (a broken chunk's token count)
    out: Any = None                       # the client's stream, once this chunk opened it

    @property
    def broken(self) -> bool:
        """Its replica failed mid-way (the connection broke, or the stream ended without a finish)."""
        return self.status == 502 or (self.error is None and self.status == 200 and self.finish_reason is None)


def _usage(obj: dict[str, Any], out: _Chunk) -> None:
    u = obj.get("usage")
    if isinstance(u, dict):
        out.prompt_tokens = int(u.get("prompt_tokens") or 0)
        out.completion_tokens = int(u.get("completion_tokens") or 0)
        out.cached_tokens = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _error_text(c: _Chunk) -> str:
    return (c.error or b"the stream ended before a finish reason").decode(errors="replace")


class ChunkedDecode:
    """The gateway stage: per-replica slot queues and the chunk loop."""

    def __init__(self, settings: ChunkedSettings, registry: CollectorRegistry, tracer: trace.Tracer,
                 block_size: Callable[[Backend], int]) -> None:
        self.settings = settings
        self.metrics = ChunkMetrics(registry)
        self.tracer = tracer
        self.block_size = block_size
        self.queues: dict[str, SlotQueue] = {}

    def chunk_tokens(self, headers: Any, payload: dict[str, Any], operation: str) -> int:
        """The chunk size for this request (0: not chunked): the header, else the policy's."""
        raw = headers.get(names.HEADER_CHUNK_TOKENS)
        n = self.settings.chunk_tokens
        if raw is not None:
            if not raw.strip().isdigit():
                raise RequestError(f"{names.HEADER_CHUNK_TOKENS} must be a non-negative integer", None)
            n = int(raw)
        if n <= 0 or payload.get("n", 1) not in (1, None) or payload.get("logprobs"):
            return 0
        limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
        if limit is not None and (type(limit) is not int or limit < 1):
            raise RequestError("`max_tokens` must be a positive integer", "max_tokens")
        if type(payload.get("min_tokens") or 0) is not int:
            raise RequestError("`min_tokens` must be an integer", "min_tokens")
        if operation != "chat" and not isinstance(payload.get("prompt"), str):
            return 0            # token-id and batched prompts: the generated ids are not returned
        return n

    def queue(self, r: Backend) -> SlotQueue:
        q = self.queues.get(r.name)
        if q is None:
            s = self.settings
            q = self.queues[r.name] = SlotQueue(s.slots_per_replica, s.reserved_slots, s.aging_s)
        return q

    async def serve(self, request: web.Request, ex: Exchange, upstream: Upstream,
                    on_first_token: Callable[[], None], on_usage: Callable[[dict[str, Any]], None],
                    reroute: Callable[[Backend, str], Backend | None], max_resumes: int) -> web.StreamResponse:
        """Generate `ex` in chunks on the replica it was routed to (`ex.served`); when that replica
        fails, on the one `reroute(lost replica, error)` picks (None: none is left)."""
        assert ex.served is not None
        r, payload, operation, span = ex.served.replica, ex.payload, ex.operation, ex.span
        stream, client_usage, chunk_tokens = ex.stream, ex.client_usage, ex.chunk_tokens
        limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
        min_tokens = payload.get("min_tokens") or 0
        rank = class_rank(request.headers.get(names.HEADER_PRIORITY) or self.settings.default_priority)
        tenant = request.headers.get(names.HEADER_TENANT, "default")
        path = ex.path
        q = self.queue(r)
        out: web.StreamResponse | None = None
        generated, total, index, resumes = "", 0, 0, 0
        first: _Chunk | None = None
        last = _Chunk()
        ident: dict[str, Any] = {}        # the first chunk's id and created: the one stream's
        while True:
            n = chunk_tokens if limit is None else min(chunk_tokens, limit - total)
            body = resume_body(payload, operation, generated) if generated else dict(payload)
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = n
            if min_tokens:
                body["min_tokens"] = max(0, min(n, min_tokens - total))
            if stream:
                body["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
            waited, reason = await q.acquire(rank, tenant)
            try:
                with self.tracer.start_as_current_span(names.SPAN_CHUNK, kind=SpanKind.CLIENT) as cs:
                    last, out = await self._call(upstream, r, path, body, stream, ident, out, request,
                                                 ex.headers, on_first_token)
                    self._record(cs, r, index, n, waited, reason, rank, tenant, last)
            finally:
                q.release()
            if last.broken and resumes < max_resumes and (other := reroute(r, _error_text(last))) is not None:
                if first is None and last.first is not None:   # the usage counts the original prompt
                    first = _Chunk(prompt_tokens=len(ex.tokens), first=last.first)
                generated += last.text
                total += last.streamed
                r, q, resumes = other, self.queue(other), resumes + 1
                continue
            if last.error is not None or last.status != 200:
                break
            if first is None:
                first = last
            generated += last.text
            total += last.completion_tokens
            index += 1
            if last.finish_reason != "length" or (limit is not None and total >= limit) or last.completion_tokens == 0:
                break
        span.set_attribute(names.CHUNK_COUNT, index)
        span.set_attribute(names.CHUNK_PRIORITY, CLASSES[rank])
        return await self._finish(span, r, out, first, last, generated, total, stream, client_usage, ex.headers,
                                  operation, on_usage)

    def _record(self, cs: trace.Span, r: Backend, index: int, n: int, waited: float, reason: str, rank: int,
                tenant: str, c: _Chunk) -> None:
        cls = CLASSES[rank]
        self.metrics.chunks.labels(cls).inc()
        self.metrics.queue.labels(cls).observe(waited)
        if reason != "none":
            self.metrics.holds.labels(cls, reason).inc()
        cs.set_attribute(names.REPLICA, r.name)
        cs.set_attribute(names.CHUNK_INDEX, index)
        cs.set_attribute(names.CHUNK_SIZE, n)
        cs.set_attribute(names.CHUNK_WAIT_MS, waited * 1000)
        cs.set_attribute(names.CHUNK_HOLD_REASON, reason)
        cs.set_attribute(names.CHUNK_PRIORITY, cls)
        cs.set_attribute(names.CHUNK_TENANT, tenant)
        cs.set_attribute(names.CHUNK_CACHED_TOKENS, c.cached_tokens)
        cs.set_attribute(names.CHUNK_GENERATED_TOKENS, c.completion_tokens)
        cs.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, c.status)
        if index and c.status == 200:
            # an engine computes a prompt's last token, and the tail past the last full block
            hit = c.prompt_tokens - c.cached_tokens <= self.block_size(r)
            cs.set_attribute(names.CHUNK_RESUME_HIT, hit)
            self.metrics.resumes.labels("hit" if hit else "miss").inc()
        if c.error is not None or c.status != 200:
            cs.set_status(Status(StatusCode.ERROR, f"chunk failed with {c.status}"))

    async def _call(self, upstream: Upstream, r: Backend, path: str,
                    body: dict[str, Any], stream: bool, ident: dict[str, Any], out: web.StreamResponse | None,
                    request: web.Request, headers: Callable[[], dict[str, str]],
                    on_first_token: Callable[[], None]) -> tuple[_Chunk, web.StreamResponse | None]:
        c = _Chunk()
        try:
            async with upstream.post(r, path, msgspec.json.encode(body), stream) as resp:
                c.status = resp.status
                if resp.status != 200:
                    c.error = await resp.read()
                    return c, out
                if not stream:
                    obj = msgspec.json.decode(await resp.read())
                    choice = (obj.get("choices") or [{}])[0]
                    msg = choice.get("message") or {}
                    c.text = (msg.get("content") if "message" in choice else choice.get("text")) or ""
                    c.finish_reason = choice.get("finish_reason")
                    c.first = obj
                    _usage(obj, c)
                    return c, out
                return await self._relay(resp, c, ident, out, request, headers, on_first_token)
        except (TimeoutError, aiohttp.ClientError) as exc:
            c.status = 502
            c.error = error_json(f"{r.name}: {type(exc).__name__}: {exc}")
            return c, c.out or out

    async def _relay(self, resp: aiohttp.ClientResponse, c: _Chunk, ident: dict[str, Any],
                     out: web.StreamResponse | None,
                     request: web.Request, headers: Callable[[], dict[str, str]],
                     on_first_token: Callable[[], None]) -> tuple[_Chunk, web.StreamResponse | None]:
        """Relay one chunk's events: later chunks lose the role delta, no chunk but the last keeps a
        finish_reason (decided by the caller: `length` is held back and re-sent at the end), no usage."""
        buf = b""
        async for data in resp.content.iter_any():
            buf += data
            *events, buf = buf.split(b"\n\n")
            send: list[bytes] = []
            for ev in events:
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                obj = msgspec.json.decode(ev[6:])
                if "error" in obj:
                    c.error = ev + b"\n\n"
                    break
                if obj.get("usage"):
                    _usage(obj, c)
                obj.pop("usage", None)
                resumed = bool(ident)
                if resumed:
                    obj.update(ident)
                else:
                    ident.update(id=obj.get("id"), created=obj.get("created"))
                choices = obj.get("choices") or []
                if not choices:
                    continue
                ch = choices[0]
                delta = ch.get("delta")
                piece = (delta.get("content") if isinstance(delta, dict) else ch.get("text")) or ""
                c.text += piece
                c.streamed += bool(piece)
                if ch.get("finish_reason") is not None:
                    c.finish_reason = ch["finish_reason"]
                    if c.finish_reason == "length":
                        ch["finish_reason"] = None
                        if not piece:
                            continue
                if resumed and isinstance(delta, dict):
                    delta.pop("role", None)
                    if not delta and ch.get("finish_reason") is None:
                        continue
                if c.first is None:
                    c.first = obj
                send.append(b"data: " + msgspec.json.encode(obj) + b"\n\n")
            if send:
                if out is None:
                    out = web.StreamResponse(status=200, headers={
                        **headers(), "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                    await out.prepare(request)
                    on_first_token()
                    c.out = out
                await out.write(b"".join(send))
            if c.error is not None:
                break
        return c, out

    async def _finish(self, span: trace.Span, r: Backend, out: web.StreamResponse | None, first: _Chunk | None,
                      last: _Chunk, generated: str, total: int, stream: bool, client_usage: bool,
                      headers: Callable[[], dict[str, str]], operation: str,
                      on_usage: Callable[[dict[str, Any]], None]) -> web.StreamResponse:
        usage: dict[str, Any] | None = None
        if first is not None:
            usage = {"prompt_tokens": first.prompt_tokens, "completion_tokens": total,
                     "total_tokens": first.prompt_tokens + total,
                     "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}
            on_usage(usage)
        failed = last.error is not None or last.status != 200
        span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, 200 if out is not None else last.status)
        if failed:
            span.set_status(Status(StatusCode.ERROR, f"a chunk failed with {last.status}"))
        if not stream or out is None:
            if failed:      # nothing reached the client yet: the upstream error as it was
                return web.Response(body=last.error, status=last.status if last.status != 200 else 502,
                                    headers={**headers(), "Content-Type": "application/json"})
            assert first is not None and isinstance(first.first, dict)
            obj = dict(first.first)
            ch = dict(obj["choices"][0])
            if operation == "chat":
                ch["message"] = {**ch["message"], "content": generated}
            else:
                ch["text"] = generated
            ch["finish_reason"] = last.finish_reason
            obj["choices"] = [ch]
            obj["usage"] = usage
            return web.Response(body=msgspec.json.encode(obj), status=200,
                                headers={**headers(), "Content-Type": "application/json"})
        tail = b""
        if failed:
            tail += last.error if last.error and last.error.startswith(b"data: ") else (
                b"data: " + (last.error or b"{}") + b"\n\n")
        else:
            assert first is not None and first.first is not None
            base = {k: v for k, v in first.first.items() if k not in ("choices", "usage")}
            if last.finish_reason == "length":   # held back from the last chunk's events
                end: dict[str, Any] = {"index": 0, "finish_reason": "length"}
                if operation == "chat":
                    end["delta"] = {}
                else:
                    end["text"] = ""
                tail += b"data: " + msgspec.json.encode({**base, "choices": [end]}) + b"\n\n"
            if client_usage:
                tail += b"data: " + msgspec.json.encode({**base, "choices": [], "usage": usage}) + b"\n\n"
        try:
            await out.write(tail + b"data: [DONE]\n\n")
            await out.write_eof()
        except ConnectionResetError:
            pass
        return out
