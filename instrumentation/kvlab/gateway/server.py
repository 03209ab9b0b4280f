"""The gateway's HTTP side: an OpenAI-compatible reverse proxy that routes by KV-cache affinity.

Per request: parse and validate the body, tokenize (cached), route (router.Router), then proxy
to the chosen replica over one shared keep-alive client session. Streams are passed through
event by event as they arrive. Usage is requested upstream so `cached_tokens` (the delivered
part of the hit-rate decomposition) is always seen, and stripped again if the client did not ask.
A refused connection before any byte is retried on the next-ranked replica (bounded); a stream
that breaks mid-way ends with an SSE error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from kvlab import httpedge
from kvlab.errors import NoEndpointAvailable, RequestError
from kvlab.gateway import dp as dp_view
from kvlab.gateway import retention
from kvlab.gateway.autoscale import Recommender, record_change
from kvlab.gateway.chunked.splice import ChunkedDecode
from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.discovery.base import Discovery, Endpoint
from kvlab.gateway.endpoints import Registry, Replica
from kvlab.gateway.enginetokens import EngineTokens
from kvlab.gateway.kvevents import EventFeed
from kvlab.gateway.loadview import LoadView
from kvlab.gateway.metrics import GatewayMetrics
from kvlab.gateway.parity import MATCH, MISMATCH, ParityProbe, Verdict
from kvlab.gateway.pd import Disaggregation
from kvlab.gateway.prefill import Prefill, PrefillBook
from kvlab.gateway.pull import hint as pull_hint
from kvlab.gateway.router import Routed, Router
from kvlab.gateway.scheduler import presets
from kvlab.gateway.tokens import LocalTokens, PromptTokenizer, chat_args
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
from kvlab.kvcache.transport import Received
from kvlab.telemetry import genai, names

log = logging.getLogger(__name__)

# Retried on the next replica: the replica never answered, so nothing reached the client.
_RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


_MAX_TOKEN_ID = 2**31   # no vocabulary is larger; bigger ids would overflow the block hashing

_PASSED_THROUGH = (names.HEADER_REPLICA, names.HEADER_KV_TRANSFER_TOKENS, names.HEADER_KV_TRANSFER_MS)


def _exemplar(span: trace.Span) -> dict[str, str] | None:
    """The trace-id exemplar for a latency observation (None when the span is not recorded)."""
    ctx = span.get_span_context()
    return {"trace_id": format(ctx.trace_id, "032x")} if ctx.is_valid and ctx.trace_flags.sampled else None

class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _WithUsage(msgspec.Struct):
    choices: list[Any] = []
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)


def _json(value: Any) -> str:
    """JSON text for a span attribute (msgspec: a fraction of json.dumps' cost on the hot path)."""
    return msgspec.json.encode(value).decode()


def _upstream_error(message: str, status: int = 502) -> web.Response:
    body = {"error": {"message": message, "type": "UpstreamError", "param": None, "code": status}}
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


class Gateway:
    """The gateway's state and aiohttp application."""

    def __init__(self, cfg: PolicyConfig, discovery: Discovery, tokenizer: PromptTokenizer | EngineTokens,
                 model: str | None = None, scrape_interval_ms: int | None = None) -> None:
        self.cfg = cfg
        self.policy = cfg.name
        self.discovery = discovery
        self.tokenizer = LocalTokens(tokenizer) if isinstance(tokenizer, PromptTokenizer) else tokenizer
        self.model = model
        self.registry = Registry(cfg.health.eject_after_failures, cfg.health.readmit_after_s)
        self.registry.on_eject = self._on_eject
        self.precise = PreciseIndex(cfg.index.speculative_ttl_s)
        self.approx = ApproximateIndex(cfg.index.approx_capacity_blocks)
        self.router = Router(cfg, self.registry, self.precise, self.approx, presets.build(cfg))
        self.metrics = GatewayMetrics(self._snapshot)
        self.feed = EventFeed(self.precise, self.approx, cfg.kv_events_resync_s, on_batch=self._on_batch)
        self.tracer = trace.get_tracer("kvlab.gateway")
        self.scrape_interval_s = (scrape_interval_ms or cfg.health.scrape_interval_ms) / 1000.0
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._feeds: dict[str, asyncio.Task[None]] = {}
        self._seen_gaps: dict[str, tuple[int, int]] = {}
        t = cfg.timeouts
        self._timeout_stream = aiohttp.ClientTimeout(total=t.total_s, sock_connect=t.connect_s,
                                                     sock_read=t.stream_idle_s)
        self._timeout_unary = aiohttp.ClientTimeout(total=t.total_s, sock_connect=t.connect_s, sock_read=t.first_byte_s)
        self.ready = asyncio.Event()
        self.autoscaler = Recommender(cfg.autoscale)
        self.pd = Disaggregation(self)
        self.prefill = PrefillBook()
        self.chunked = ChunkedDecode(cfg.chunked, self.metrics.registry, self.tracer, self.router.block_size)
        self.parity = (ParityProbe(tokenizer, model, on_verdict=self._on_parity)
                       if isinstance(tokenizer, PromptTokenizer) else None)

    # ---- lifecycle ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.limits.max_body_bytes,
                              middlewares=[httpedge.errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/debug/endpoints", self.debug_endpoints)
        app.router.add_get("/debug/autoscale", self.debug_autoscale)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    def runner(self) -> web.AppRunner:
        """The app with its server settings: a client that goes away cancels its handler, which closes
        the upstream request (the engine aborts it); a connection that sends no complete request
        within `client_idle_s` is closed (slowloris)."""
        return web.AppRunner(self.app(), access_log=None, handle_signals=False, handler_cancellation=True,
                             keepalive_timeout=self.cfg.timeouts.client_idle_s)

    async def _startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        if self.parity is not None:
            self.parity.session = self.session
        if isinstance(self.tokenizer, EngineTokens):
            self.tokenizer.bind(self.session, self.registry)
        loadview = LoadView(self.registry, self.session, self.scrape_interval_s, self.cfg.timeouts.scrape_s)
        self._tasks.append(asyncio.create_task(self._discover()))
        self._tasks.append(asyncio.create_task(loadview.run()))
        self._tasks.append(asyncio.create_task(self._autoscale()))

    async def _cleanup(self, app: web.Application) -> None:
        for t in [*self._tasks, *self._feeds.values()]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._feeds.values(), return_exceptions=True)
        if self.parity is not None:
            await self.parity.close()
        if self.session is not None:
            await self.session.close()

    async def _autoscale(self) -> None:
        """Re-evaluate the desired-replica recommendation every scrape interval (autoscale.py)."""
        while True:
            await asyncio.sleep(self.scrape_interval_s)
            try:
                prev = self.autoscaler.last
                rec = self.autoscaler.observe(self.registry.candidates())
                self.metrics.desired_replicas.set(rec.desired)
                self.metrics.current_replicas.set(rec.current)
                if prev is None or prev.desired != rec.desired:
                    record_change(self.tracer, prev, rec)
            except Exception:  # the signal never takes the gateway down
                log.exception("autoscale evaluation failed")

    async def debug_autoscale(self, request: web.Request) -> web.Response:
        rec = self.autoscaler.last
        return web.json_response({"settings": msgspec.to_builtins(self.cfg.autoscale),
                                  "recommendation": None if rec is None else msgspec.to_builtins(rec)})

    async def _discover(self) -> None:
        try:
            await self.discovery.run(self.set_endpoints)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery stopped; keeping the last known endpoints")

    async def set_endpoints(self, endpoints: list[Endpoint]) -> None:
        added, removed = self.registry.update(endpoints)
        for r in removed:
            task = self._feeds.pop(r.name, None)
            if task is not None:
                task.cancel()
            self.precise.remove(r.name)
            self.approx.remove(r.name)
            if self.parity is not None:
                self.parity.stop(r.name)
                if r.tokenizer in (MATCH, MISMATCH):
                    self.metrics.tokenizer_parity.remove(r.name)
        for r in added:
            if self.parity is not None:
                self.parity.start(r)
            else:
                r.tokenizer = "engine"     # tokens-in, tokens-out: the ids are the engine's own
            if r.endpoint.kv_events and self.cfg.index.kind == "precise":
                self._feeds[r.name] = asyncio.create_task(self._run_feed(r))
        self.ready.set()

    async def _run_feed(self, r: Replica) -> None:
        try:
            await self.feed.run(r)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never takes the gateway down; the replica falls back to approximate
            r.events_state = "stale"
            log.warning("KV-event feed of %s stopped: %s", r.name, exc)

    def _on_batch(self, r: Replica, rec: Received) -> None:
        self.metrics.kv_events.labels(r.name).inc()
        if rec.gap or rec.restarted:
            self.metrics.kv_event_gaps.labels(r.name, "restart" if rec.restarted else "gap").inc()

    def _on_parity(self, r: Replica, verdict: Verdict) -> None:
        if verdict.state in (MATCH, MISMATCH):
            self.metrics.tokenizer_parity.labels(r.name).set(1.0 if verdict.state == MATCH else 0.0)

    def _on_eject(self, r: Replica) -> None:
        self.metrics.ejections.labels(r.name).inc()
        log.warning("ejected %s: %s", r.name, r.last_error)

    def _snapshot(self) -> Iterator[tuple[str, int, bool, int, int, str]]:
        for r in list(self.registry.replicas.values()):
            yield (r.name, r.inflight, r.healthy, self.precise.blocks(r.name), self.approx.blocks(r.name),
                   r.events_state)

    # ---- small endpoints ---------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        healthy = [r.name for r in self.registry.replicas.values() if r.healthy]
        status = 200 if healthy else 503
        mismatch = [r.name for r in self.registry.replicas.values() if r.tokenizer == MISMATCH]
        return web.json_response({"status": "ok" if healthy else "no healthy replica",
                                  "policy": self.policy, "healthy": healthy,
                                  "tokenizer": {"source": self.tokenizer.source, "mismatch": mismatch}},
                                 status=status)

    async def prometheus(self, request: web.Request) -> web.Response:
        # Prometheus asks for OpenMetrics when exemplar storage is on: only that format carries
        # the trace-id exemplars Grafana links from latency panels to traces
        if "application/openmetrics-text" in request.headers.get("Accept", ""):
            return web.Response(body=openmetrics.generate_latest(self.metrics.registry),  # type: ignore[no-untyped-call]
                                headers={"Content-Type": openmetrics.CONTENT_TYPE_LATEST})
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def debug_endpoints(self, request: web.Request) -> web.Response:
        out = []
        for r in self.registry.replicas.values():
            out.append({
                "name": r.name, "url": r.url, "kv_events": r.endpoint.kv_events, "role": r.endpoint.role,
                "healthy": r.healthy, "failures": r.failures, "ejections": r.ejections,
                "last_error": r.last_error, "last_scrape": r.last_scrape,
                "load": {"waiting": r.waiting, "running": r.running, "kv_usage": r.kv_usage,
                         "inflight": r.inflight, "inflight_tokens": r.inflight_tokens},
                "block_size": self.router.block_size(r), "num_gpu_blocks": r.num_gpu_blocks,
                "index": {"used": "precise" if self.router.uses_precise(r) else "approximate",
                          "precise_blocks": self.precise.blocks(r.name),
                          "speculative_blocks": self.precise.speculative_blocks(r.name),
                          "approximate_blocks": self.approx.blocks(r.name)},
                "tokenizer": {"state": r.tokenizer, "detail": r.tokenizer_detail},
                "events": {"state": r.events_state, "batches": r.events_received,
                           "gaps": r.events_gaps, "restarts": r.events_restarts, "replayed": r.events_replayed},
                "routed": r.routed,
            })
        return web.json_response({"policy": self.policy, "replicas": out})

    async def models(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        for r in self.registry.candidates():
            try:
                async with self.session.get(r.url + "/v1/models", timeout=self._timeout_unary) as resp:
                    body = await resp.read()
                    return web.Response(body=body, status=resp.status, content_type="application/json")
            except _RETRYABLE + (asyncio.TimeoutError,) as exc:
                self.registry.failure(r, f"models: {exc}")
        return _upstream_error("no healthy replica to route to", 503)

    # ---- the proxy ---------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "text_completion")

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        payload: dict[str, Any] = httpedge.decode(await httpedge.read_body(
            request, self.cfg.limits.max_body_bytes, self.cfg.timeouts.client_body_s))
        if "stream" in payload and not isinstance(payload["stream"], bool | None):
            raise RequestError("`stream` must be a boolean", "stream")
        return payload

    async def _tokenize(self, payload: dict[str, Any], operation: str) -> tuple[list[int], int]:
        """The prompt's token ids as the engine computes them (kvlab.tokenizer, vLLM's rules)."""
        tok = self.tokenizer
        if operation == "chat":
            return await tok.encode_chat(payload.get("messages"), **chat_args(payload))
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt = prompt[0]   # a batch is routed by its first prompt
        add = payload.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise RequestError("`add_special_tokens` must be a boolean", "add_special_tokens")
        if isinstance(prompt, str):
            return await tok.encode_text(prompt, add)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < _MAX_TOKEN_ID for t in prompt):
                raise RequestError(f"token ids must be between 0 and {_MAX_TOKEN_ID - 1}", "prompt")
            return list(prompt), 0
        raise RequestError("`prompt` must be a string, a list of strings or a list of token ids", "prompt")

    async def _proxy(self, request: web.Request, operation: str) -> web.StreamResponse:
        t_start = time.perf_counter()
        ctx = propagate.extract(request.headers)
        with self.tracer.start_as_current_span(names.genai_span_name(operation), context=ctx, kind=SpanKind.SERVER,
                                               attributes=genai.span_attributes(names.SPAN_GATEWAY_REQUEST,
                                                                                f"http://{request.host}")) as span:
            span.set_attribute(names.GEN_AI_OPERATION_NAME, operation)
            span.set_attribute(names.POLICY, self.policy)
            base_headers = {names.HEADER_POLICY: self.policy}
            try:
                payload = await self._read_json(request)
                stream = bool(payload.get("stream"))
                model = payload.get("model")
                if isinstance(model, str):
                    span.set_attribute(names.GEN_AI_REQUEST_MODEL, model)
                    span.update_name(names.genai_span_name(operation, model))
                if isinstance(payload.get("max_tokens"), int):
                    span.set_attribute(names.GEN_AI_REQUEST_MAX_TOKENS, payload["max_tokens"])
                span.set_attribute(names.GEN_AI_REQUEST_STREAM, stream)
                t0 = time.perf_counter()   # attributes, not a child span: one span fewer per request
                tokens, cache_hit = await self._tokenize(payload, operation)
                dt = time.perf_counter() - t0
                span.set_attributes({names.TOKENIZE_SOURCE: self.tokenizer.source, names.TOKENIZE_CACHED: cache_hit,
                                     names.TOKENIZE_MS: dt * 1000})
                self.metrics.tokenize.observe(dt)
                limit = self.cfg.limits.max_prompt_tokens
                if limit is not None and len(tokens) > limit:
                    raise RequestError(f"prompt of {len(tokens)} tokens exceeds the gateway limit of {limit}", "prompt")
                span.set_attribute(names.PROMPT_TOKENS, len(tokens))
                upstream, typed = await self._retention(request, payload, tokens, operation)
                routed = self._schedule(tokens, typed)
                chunk = self.chunked.chunk_tokens(request.headers, payload, operation)
            except RequestError as err:
                span.set_status(Status(StatusCode.ERROR, err.message))
                span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, err.status)
                return httpedge.json_error(err, base_headers)
            except NoEndpointAvailable as err:
                span.set_status(Status(StatusCode.ERROR, str(err)))
                span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, 503)
                return _upstream_error(str(err), 503)
            d = routed.decision
            span.set_attribute(names.PREFIX_AVAILABLE_TOKENS, d.available_tokens)
            headers = {**base_headers,
                       names.HEADER_PROMPT_TOKENS: str(len(tokens)),
                       names.HEADER_PREFIX_AVAILABLE: str(d.available_tokens)}
            # ask upstream for usage (delivered = cached_tokens), strip it later if not asked for
            client_usage = True
            if stream:
                opts = payload.get("stream_options")
                client_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
                if not client_usage:
                    payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
            if chunk:   # chunked decoding replaces P/D and retries for this request (docs/chunked-decoding.md)
                return await self._chunked(request, span, routed, payload, operation, chunk, client_usage,
                                           headers, t_start)
            path = "/v1/chat/completions" if operation == "chat" else "/v1/completions"
            call = await self.pd.run(path, payload, tokens, routed, span, headers)
            body = msgspec.json.encode(payload)
            return await self._forward(request, span, routed, body, stream, client_usage, headers, t_start, call,
                                       upstream)

    async def _chunked(self, request: web.Request, span: trace.Span, routed: Routed, payload: dict[str, Any],
                       operation: str, chunk: int, client_usage: bool, headers: dict[str, str],
                       t_start: float) -> web.StreamResponse:
        """Generation in chunks on the chosen replica (gateway/chunked/)."""
        assert self.session is not None
        cand = routed.decision.ranked[0]
        r = cand.replica
        r.routed += 1
        stream = bool(payload.get("stream"))
        headers[names.HEADER_ROUTED_TO] = r.name
        headers[names.HEADER_PREFIX_PREDICTED] = str(cand.prefix_tokens)
        headers[names.HEADER_PREFIX_SPECULATIVE] = str(cand.speculative_tokens)
        span.set_attribute(names.REPLICA, r.name)
        span.set_attribute(names.PREFIX_PREDICTED_TOKENS, cand.prefix_tokens)

        def first_token() -> None:
            self.metrics.ttft.labels(self.policy, r.name).observe(time.perf_counter() - t_start,
                                                                  exemplar=_exemplar(span))

        def usage(u: dict[str, Any]) -> None:
            self._delivered(span, msgspec.convert(u, _Usage), headers, set_header=not stream)

        resp = await self.chunked.serve(request, span, self.session,
                                        self._timeout_stream if stream else self._timeout_unary, r, payload,
                                        operation, chunk, headers, client_usage, first_token, usage)
        self.metrics.requests.labels(r.name, self.policy, str(resp.status)).inc()
        return resp

    async def _retention(self, request: web.Request, payload: dict[str, Any], tokens: list[int],
                         operation: str) -> tuple[dict[str, str], str | None]:
        """Upstream headers with the request's retention directives (gateway/retention.py) and the
        typed prefix for the decision span: the client's own header passed through, else derived
        from a chat request's roles by the policy. A client's body field is left to the replica."""
        own = request.headers.get(names.HEADER_RETENTION)
        if own is not None:
            return {names.HEADER_RETENTION: own}, own
        if operation != "chat" or self.cfg.retention.mode == "off" or "retention_directives" in payload:
            return {}, None
        found = await retention.derive(self.cfg.retention, payload, tokens, request.headers.get(names.HEADER_KV_HINT),
                                       self.tokenizer, chat_args(payload))
        if not found:
            return {}, None
        return {names.HEADER_RETENTION: retention.header(found)}, retention.span_value(found)

    def _schedule(self, tokens: list[int], typed: str | None = None) -> Routed:
        with self.tracer.start_as_current_span(names.SPAN_SCHEDULE) as s:
            routed = self.router.route(tokens)
            d = routed.decision
            self.metrics.routing.labels(self.policy).observe(routed.total_s)
            self.metrics.decisions.labels(self.policy, d.reason).inc()
            if s.is_recording():
                s.set_attribute(names.POLICY, self.policy)
                s.set_attribute(names.SCHEDULE_CHOSEN, d.chosen.name)
                s.set_attribute(names.SCHEDULE_REASON, d.reason)
                dp_view.annotate(s, d)
                s.set_attribute(names.SCHEDULE_SHADOW, d.shadow)
                s.set_attribute(names.SCHEDULE_SHADOW_CHOICE, d.best.name)
                s.set_attribute(names.SCHEDULE_WEIGHTS, _json(self.router.scheduler.weights))
                s.set_attribute(names.SCHEDULE_CANDIDATES, _json([
                    {"replica": c.name, "prefix_tokens": c.prefix_tokens,
                     "speculative_tokens": c.speculative_tokens,
                     "scores": {k: round(v, 4) for k, v in c.scores.items()}, "total": round(c.total, 4),
                     "waiting": c.replica.waiting, "running": c.replica.running,
                     "kv_usage": round(c.replica.kv_usage, 4), "inflight": c.replica.inflight,
                     "inflight_tokens": c.replica.inflight_tokens,
                     "pending_prefill_tokens": c.replica.pending_prefill_tokens,
                     "prefill_ms_per_token": c.replica.prefill_ms_per_token,
                     "filtered": c.name in d.filtered}
                    for c in d.candidates]))
                s.set_attribute(names.SCHEDULE_INDEX, _json(routed.index_of))
                s.set_attribute(names.SCHEDULE_KEYS_MS, routed.keys_s * 1000)
                s.set_attribute(names.PREFIX_AVAILABLE_TOKENS, d.available_tokens)
                s.set_attribute(names.PREFIX_PREDICTED_TOKENS, d.predicted_tokens)
                s.set_attribute(names.PREFIX_SPECULATIVE_TOKENS, d.speculative_tokens)
                s.set_attribute(names.PROMPT_TOKENS, len(tokens))
                if routed.cpu:   # tier-split prefixes (docs/tiered.md)
                    s.set_attribute(names.PREFIX_TIERS, _json([
                        {"replica": c.name, "gpu_tokens": c.prefix_tokens - c.cpu_tokens, "cpu_tokens": c.cpu_tokens}
                        for c in d.candidates]))
                    s.set_attribute(names.PREFIX_CPU_TOKENS, d.chosen.cpu_tokens)
                if typed is not None:
                    s.set_attribute(names.RETENTION_DIRECTIVES, typed)
                    self._annotate_typed(s, routed)
            if routed.pull is not None:
                p = routed.pull
                with self.tracer.start_as_current_span(names.SPAN_PULL_DECISION) as ps:
                    ps.set_attributes({names.PULL_CHOICE: p.choice, names.PULL_HOLDER: p.holder,
                                       names.PULL_TARGET: p.target, names.PULL_HOLDER_TOKENS: p.holder_prefix,
                                       names.PULL_COSTS: _json({k: round(v, 2) for k, v in p.costs.items()})})
        return routed

    def _annotate_typed(self, s: trace.Span, routed: Routed) -> None:
        """The decision span's typed prefix: the directives sent and, from the index, the retention
        classes of the prefix the chosen replica holds."""
        chosen = routed.decision.chosen
        keys = routed.keys_by_size.get(self.router.block_size(chosen.replica), [])
        s.set_attribute(names.RETENTION_PREFIX_CLASSES,
                        _json(self.router.precise.prefix_classes(chosen.name, keys)))

    async def _forward(self, request: web.Request, span: trace.Span, routed: Routed, body: bytes,
                       stream: bool, client_usage: bool, headers: dict[str, str],
                       t_start: float, call: str = names.SPAN_UPSTREAM,
                       upstream: dict[str, str] | None = None) -> web.StreamResponse:
        assert self.session is not None
        d = routed.decision
        tries = d.ranked[: 1 + self.cfg.limits.max_retries]
        last_error = "no replica tried"
        for attempt, cand in enumerate(tries):
            r = cand.replica
            if attempt:
                self.metrics.retries.labels(r.name).inc()
                self.router.learn(r, routed.keys_by_size)
            headers[names.HEADER_ROUTED_TO] = r.name
            headers[names.HEADER_PREFIX_PREDICTED] = str(cand.prefix_tokens)
            headers[names.HEADER_PREFIX_SPECULATIVE] = str(cand.speculative_tokens)
            span.set_attribute(names.REPLICA, r.name)
            span.set_attribute(names.PREFIX_PREDICTED_TOKENS, cand.prefix_tokens)
            span.set_attribute(names.PREFIX_SPECULATIVE_TOKENS, cand.speculative_tokens)
            span.set_attribute(names.SCHEDULE_ATTEMPT, attempt)
            up_name, up_attrs = genai.call_of(span, call, r.url)
            with self.tracer.start_as_current_span(up_name, kind=SpanKind.CLIENT, attributes=up_attrs) as up:
                up.set_attribute(names.REPLICA, r.name)
                up.set_attribute(names.ENDPOINT, r.url)
                up.set_attribute(names.SCHEDULE_ATTEMPT, attempt)
                out_headers = {"Content-Type": "application/json"}
                out_headers.update(upstream or {})   # retention directives (docs/semantic-kv.md)
                propagate.inject(out_headers)
                if routed.pull is not None and routed.pull.choice == "pull" and routed.pull.target == r.name:
                    out_headers[names.HEADER_KV_PULL] = pull_hint(routed.pull)
                path = "/v1/chat/completions" if request.path.endswith("chat/completions") else "/v1/completions"
                r.inflight += 1
                r.routed += 1
                work = max(0, int(headers[names.HEADER_PROMPT_TOKENS]) - cand.prefix_tokens)
                r.inflight_tokens += work
                prefill = self.prefill.start(r, work)
                try:
                    try:
                        resp = await asyncio.wait_for(self.session.post(
                            r.url + path, data=body, headers=out_headers,
                            timeout=self._timeout_stream if stream else self._timeout_unary),
                            self.cfg.timeouts.first_byte_s)
                    except _RETRYABLE as exc:
                        last_error = f"{r.name}: {type(exc).__name__}: {exc}"
                        self.metrics.upstream_errors.labels(r.name, "connect").inc()
                        self.registry.failure(r, last_error)
                        up.set_attribute(names.UPSTREAM_ERROR, "connect")
                        up.set_status(Status(StatusCode.ERROR, last_error))
                        continue
                    except TimeoutError:
                        # a hung replica: the closed connection aborts the request there (as vLLM
                        # does on a disconnect) and nothing reached the client, so the next one is tried
                        last_error = f"{r.name}: no response headers within {self.cfg.timeouts.first_byte_s:g} s"
                        self.metrics.upstream_errors.labels(r.name, "timeout").inc()
                        self.registry.failure(r, last_error)
                        up.set_attribute(names.UPSTREAM_ERROR, "timeout")
                        up.set_status(Status(StatusCode.ERROR, last_error))
                        continue
                    self.registry.success(r)
                    up.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, resp.status)
                    self.pd.observe_transfer(up, resp.headers)
                    for name in _PASSED_THROUGH:   # the replica's own x-kvlab-* facts reach the client
                        if name in resp.headers:
                            headers[name] = resp.headers[name]
                    try:
                        if stream and resp.status == 200:
                            return await self._relay_stream(request, span, up, r, resp, client_usage, headers,
                                                            t_start, prefill)
                        return await self._relay_unary(span, up, r, resp, headers)
                    except asyncio.CancelledError:
                        resp.close()   # the client went away: dropping the connection aborts the engine's work
                        raise
                    finally:
                        resp.release()
                finally:
                    r.inflight -= 1
                    r.inflight_tokens -= work
                    self.prefill.finish(prefill)
        span.set_status(Status(StatusCode.ERROR, last_error))
        span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, 502)
        self.metrics.requests.labels(d.chosen.name, self.policy, "502").inc()
        failed = _upstream_error(f"upstream failed: {last_error}")
        failed.headers.update(headers)
        return failed

    def _delivered(self, span: trace.Span, usage: _Usage | None, headers: dict[str, str],
                   set_header: bool = False) -> None:
        """Record the decomposition once the replica reports what it reused. All four counters move
        together, per served request, so ratios of their rates never divide by a window in which only
        one side moved (which made the dashboards' hit rates spike to infinity)."""
        if usage is None:
            return
        cached = (usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None) or 0
        span.set_attribute(names.PREFIX_DELIVERED_TOKENS, cached)
        counter = self.metrics.prefix_tokens
        counter.labels(self.policy, "prompt").inc(int(headers[names.HEADER_PROMPT_TOKENS]))
        counter.labels(self.policy, "available").inc(int(headers[names.HEADER_PREFIX_AVAILABLE]))
        counter.labels(self.policy, "predicted").inc(int(headers[names.HEADER_PREFIX_PREDICTED]))
        counter.labels(self.policy, "speculative").inc(int(headers[names.HEADER_PREFIX_SPECULATIVE]))
        counter.labels(self.policy, "delivered").inc(cached)
        if usage.prompt_tokens is not None:
            span.set_attribute(names.GEN_AI_USAGE_INPUT_TOKENS, usage.prompt_tokens)
        if usage.completion_tokens is not None:
            span.set_attribute(names.GEN_AI_USAGE_OUTPUT_TOKENS, usage.completion_tokens)
        if set_header:
            headers[names.HEADER_PREFIX_DELIVERED] = str(cached)

    async def _relay_unary(self, span: trace.Span, up: trace.Span, r: Replica,
                           resp: aiohttp.ClientResponse, headers: dict[str, str]) -> web.Response:
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            msg = f"{r.name} failed while answering: {type(exc).__name__}: {exc}"
            self.metrics.upstream_errors.labels(r.name, "body").inc()
            up.set_attribute(names.UPSTREAM_ERROR, "body")
            up.set_status(Status(StatusCode.ERROR, msg))
            span.set_status(Status(StatusCode.ERROR, msg))
            span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, 502)
            self.metrics.requests.labels(r.name, self.policy, "502").inc()
            out = _upstream_error(msg)
            out.headers.update(headers)
            return out
        if resp.status == 200:
            try:
                self._delivered(span, _usage_decoder.decode(data).usage, headers, set_header=True)
            except msgspec.DecodeError:
                pass
        else:
            self.metrics.upstream_errors.labels(r.name, f"status_{resp.status}").inc()
            up.set_attribute(names.UPSTREAM_ERROR, "status")
        span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, resp.status)
        self.metrics.requests.labels(r.name, self.policy, str(resp.status)).inc()
        return web.Response(body=data, status=resp.status, headers={
            **headers, "Content-Type": resp.headers.get("Content-Type", "application/json")})

    async def _relay_stream(self, request: web.Request, span: trace.Span, up: trace.Span, r: Replica,
                            resp: aiohttp.ClientResponse, client_usage: bool, headers: dict[str, str],
                            t_start: float, prefill: Prefill | None = None) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={
            **headers, "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
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
                            parsed = _usage_decoder.decode(ev[6:])
                        except msgspec.DecodeError:
                            parsed = None
                        if parsed is not None and parsed.usage is not None:
                            self._delivered(span, parsed.usage, headers)
                            if not client_usage and not parsed.choices:
                                continue   # the usage-only chunk the client did not ask for
                    send.append(ev)
                    send.append(b"\n\n")
                if send:
                    if first:
                        first = False
                        if prefill is not None:
                            self.prefill.first_token(prefill)
                        ttft = time.perf_counter() - t_start
                        span.set_attribute(names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, ttft)
                        self.metrics.ttft.labels(self.policy, r.name).observe(ttft, exemplar=_exemplar(span))
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
            up.set_attribute(names.UPSTREAM_ERROR, kind)
            up.set_status(Status(StatusCode.ERROR, msg))
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
